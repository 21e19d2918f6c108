// run.mjs - the E2B CLI (@e2b/cli, pinned) as a second real client of space's E2B surface.
//
//   node run.mjs [FILTER...]
//
// Runs the CLI's own entry point (node_modules/@e2b/cli/dist/index.js, what `npx e2b` runs)
// as a user would, configured only through the environment: E2B_API_URL, E2B_API_KEY,
// E2B_ACCESS_TOKEN (default: the API key) and E2B_SANDBOX_URL or E2B_DOMAIN. What the CLI did
// is checked with the pinned JS SDK (the same client code the CLI bundles). The scenarios
// build on each other, in this order:
//
//   template/create       `template create` from an e2b.Dockerfile, with a start and ready
//                         command and a size; the build's log printed; a sandbox of it has
//                         the Dockerfile's file and env and the start command's process
//   template/list-json    `template list -f json` shows it with its size, also with only
//                         E2B_ACCESS_TOKEN set (then the CLI sends no X-API-KEY)
//   sandbox/list          `sandbox list -m` (metadata filter), as JSON and as the table
//   sandbox/connect       `sandbox connect` in a tmux pane: a command typed there writes a
//                         file the SDK then reads, and its output shows in the pane
//   sandbox/kill          `sandbox kill <id>`, then the same id again ("wasn't found")
//   sandbox/kill-all      `sandbox kill -a -m conformance=<run>`: only this run's sandboxes
//   template/delete       `template delete <name> -y`, then list no longer shows it; an
//                         unknown name fails with the server's 404
//
// FILTER: substrings matched against "area/scenario"; a scenario whose prerequisite was
// filtered out or failed fails saying so. Exit status: 0 all selected scenarios passed,
// 1 some failed, 2 bad configuration. Every sandbox the run made carries the metadata
// conformance=<run id> and is killed at the end, and the template is deleted, passed or not.
import assert from 'node:assert/strict'
import { spawn, spawnSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { Sandbox } from 'e2b'
import {
  MULT,
  REQUEST_TIMEOUT_MS,
  RUN_ID,
  TEMPLATE as BASE,
  configProblem,
  sandboxTarget,
  waitFor,
  withDeadline,
} from '../common.mjs'

const HERE = dirname(fileURLToPath(import.meta.url))
const CLI = join(HERE, 'node_modules', '@e2b', 'cli', 'dist', 'index.js')
const NAME = `cli-${RUN_ID}`
const sdkOpts = { requestTimeoutMs: REQUEST_TIMEOUT_MS }

const problem = configProblem()
if (problem) {
  console.error(`conformance.cli: ${problem}`)
  process.exit(2)
}

// The CLI runs in a private home: no ~/.e2b/config.json of the machine's user leaks in, and
// the update notifier finds a fresh "last checked" stamp, so it asks no registry.
const WORK = mkdtempSync(join(tmpdir(), 'e2b-cli-conf-'))
const HOME = join(WORK, 'home')
const XDG = join(HOME, '.config', 'simple-update-notifier')
mkdirSync(XDG, { recursive: true })
writeFileSync(join(XDG, 'e2b__cli.json'), JSON.stringify({ lastUpdateCheck: Date.now() }))
const CLI_ENV = {
  ...process.env,
  HOME,
  XDG_CONFIG_HOME: XDG,
  // space accepts its API key as the access token (the CLI sends both headers).
  E2B_ACCESS_TOKEN: process.env.E2B_ACCESS_TOKEN || process.env.E2B_API_KEY,
  NO_COLOR: '1',
  FORCE_COLOR: '0',
}
delete CLI_ENV.E2B_TEAM_ID

/** Runs the CLI to its end: {code, out, err}. Its output is echoed, indented, as it comes. */
function cli(args, { cwd = WORK, timeoutMs = 120_000, echo = true, unset = [] } = {}) {
  return new Promise((resolve, reject) => {
    const env = { ...CLI_ENV }
    for (const k of unset) delete env[k]
    if (echo) console.log(`    $ ${unset.map((k) => `env -u ${k} `).join('')}e2b ${args.join(' ')}`)
    const p = spawn(process.execPath, [CLI, ...args], {
      cwd,
      env,
      stdio: ['ignore', 'pipe', 'pipe'],
    })
    let out = ''
    let err = ''
    const show = (s) => {
      if (echo) for (const l of s.split('\n')) if (l.trim()) console.log(`    | ${l}`)
    }
    p.stdout.on('data', (d) => {
      out += d
      show(String(d))
    })
    p.stderr.on('data', (d) => {
      err += d
      show(String(d))
    })
    const t = setTimeout(() => {
      p.kill('SIGKILL')
      reject(new Error(`e2b ${args.join(' ')}: no exit after ${timeoutMs * MULT} ms`))
    }, timeoutMs * MULT)
    p.on('error', reject)
    p.on('close', (code, signal) => {
      clearTimeout(t)
      resolve({ code: code ?? `signal ${signal}`, out, err })
    })
  })
}

function expectExit(r, code, what) {
  assert.equal(
    r.code,
    code,
    `${what}: exit ${r.code}, expected ${code}; stderr: ${r.err.trim().slice(-600)}`
  )
}

/** The JSON document the CLI printed on stdout (after its leading blank line). */
function jsonOut(r, what) {
  const s = r.out.trim()
  try {
    return JSON.parse(s)
  } catch (e) {
    throw new Error(`${what}: stdout is not JSON (${e.message}): ${s.slice(0, 300)}`)
  }
}

const created = new Set()

async function newSandbox(template, role) {
  const s = await Sandbox.create(template, {
    ...sdkOpts,
    timeoutMs: 900_000,
    metadata: { conformance: RUN_ID, role },
  })
  created.add(s.sandboxId)
  return s
}

// ---- the scenarios ----

const state = {} // what one scenario leaves for the next
const scenarios = []
function scenario(name, fn, { needs = [], timeoutMs = 180_000 } = {}) {
  scenarios.push({ name, fn, needs, timeoutMs: timeoutMs * MULT })
}

// A marker only the build's RUN step can have written, and one its ENV carries.
const BUILD_MARK = `built-${RUN_ID}`

scenario(
  'template/create',
  async () => {
    const dir = join(WORK, 'tpl')
    mkdirSync(dir)
    // FROM e2bdev/base: E2B's own base image, which space maps to its `base` template.
    writeFileSync(
      join(dir, 'e2b.Dockerfile'),
      [
        'FROM e2bdev/base',
        `ENV CLI_MARK=${RUN_ID}`,
        `RUN echo ${BUILD_MARK} > /etc/cli-mark && echo "step-output-$((6*7))-${RUN_ID}"`,
        'WORKDIR /home/user',
        '',
      ].join('\n')
    )
    const start = "bash -c 'echo up > /tmp/started; exec sleep infinity'"
    const r = await cli(
      [
        'template', 'create', NAME,
        '-c', start, '--ready-cmd', 'test -f /tmp/started',
        '--cpu-count', '1', '--memory-mb', '256',
      ],
      { cwd: dir, timeoutMs: 900_000 }
    )
    expectExit(r, 0, 'template create')
    state.built = true // from here on, the cleanup deletes it
    const all = r.out + r.err
    assert.match(all, /Found .*e2b\.Dockerfile/, 'the CLI did not pick up e2b.Dockerfile')
    // The build's own log, streamed by the SDK's logger: the RUN step's output (its
    // arithmetic expanded, so not merely an echo of the command line).
    assert.ok(
      all.includes(`step-output-42-${RUN_ID}`),
      "the build's log lacks the RUN step's output"
    )
    // (The SDK's logger keeps its own start and end entries off the screen.)
    assert.match(all, /Building sandbox template .* finished/, 'no success message')

    const s = await newSandbox(NAME, 'template')
    try {
      const mark = await s.files.read('/etc/cli-mark')
      assert.equal(mark, `${BUILD_MARK}\n`, '/etc/cli-mark from the RUN step')
      // The start command's process, from /proc (the base image has no pgrep).
      const r = await s.commands.run(
        'echo "$CLI_MARK"; cat /tmp/started; ' +
          "for c in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $c; echo; done 2>/dev/null | " +
          "grep -c '^sleep infinity'"
      )
      const lines = r.stdout.trim().split('\n')
      assert.equal(lines[0], RUN_ID, 'ENV CLI_MARK in the sandbox')
      assert.equal(lines[1], 'up', "the start command's file")
      assert.equal(lines[2], '1', "the start command's process (sleep infinity) runs")
    } finally {
      await Sandbox.kill(s.sandboxId, sdkOpts)
      created.delete(s.sandboxId)
    }
  },
  { timeoutMs: 960_000 }
)

scenario(
  'template/list-json',
  async () => {
    const r = await cli(['template', 'list', '-f', 'json'])
    expectExit(r, 0, 'template list')
    const list = jsonOut(r, 'template list -f json')
    assert.ok(Array.isArray(list), 'template list -f json: not an array')
    const t = list.find((x) => x.templateID === NAME || (x.aliases || []).includes(NAME))
    assert.ok(t, `${NAME} not listed: ${list.map((x) => x.templateID).join(', ')}`)
    assert.ok((t.aliases || []).includes(NAME), `aliases ${JSON.stringify(t.aliases)}`)
    assert.equal(t.cpuCount, 1, 'cpuCount')
    assert.equal(t.memoryMB, 256, 'memoryMB')
    // With the access token alone (no API key: the CLI sends only Authorization: Bearer),
    // as E2B's template routes allow.
    const tok = await cli(['template', 'list', '-f', 'json'], {
      unset: ['E2B_API_KEY'],
      echo: false,
    })
    expectExit(tok, 0, 'template list with only E2B_ACCESS_TOKEN')
    const viaToken = jsonOut(tok, 'template list with only E2B_ACCESS_TOKEN')
    assert.ok(
      viaToken.some((x) => x.templateID === NAME),
      `${NAME} not listed with only E2B_ACCESS_TOKEN`
    )
    // The table form too (what a user sees by default).
    const p = await cli(['template', 'list'], { echo: false })
    expectExit(p, 0, 'template list (table)')
    assert.ok(p.out.includes(NAME), `the table does not show ${NAME}`)
  },
  { needs: ['template/create'] }
)

scenario('sandbox/list', async () => {
  const a = await newSandbox(BASE, 'a')
  const b = await newSandbox(BASE, 'b')
  state.a = a.sandboxId
  state.b = b.sandboxId
  const r = await cli(['sandbox', 'list', '-m', `conformance=${RUN_ID}`, '-f', 'json'])
  expectExit(r, 0, 'sandbox list -f json')
  const got = jsonOut(r, 'sandbox list -f json')
  const ids = got.map((x) => x.sandboxId).sort()
  assert.deepEqual(ids, [a.sandboxId, b.sandboxId].sort(), 'sandboxes with this run metadata')
  const ofA = got.find((x) => x.sandboxId === a.sandboxId)
  assert.equal(ofA.metadata?.role, 'a', 'metadata in the listing')
  // A filter nothing matches, and the table.
  const none = await cli(['sandbox', 'list', '-m', `conformance=${RUN_ID}-none`, '-f', 'json'])
  expectExit(none, 0, 'sandbox list (no match)')
  assert.deepEqual(jsonOut(none, 'sandbox list (no match)'), [])
  const t = await cli(['sandbox', 'list', '-m', `role=b,conformance=${RUN_ID}`], { echo: false })
  expectExit(t, 0, 'sandbox list (table)')
  assert.ok(t.out.includes(b.sandboxId), 'the table shows b')
  assert.ok(!t.out.includes(a.sandboxId), 'the table does not show a (role=b filter)')
  state.listed = true
})

/** tmux on a private socket: a server of its own, started with this process's environment. */
function tmux(...args) {
  const r = spawnSync('tmux', ['-S', join(WORK, 'tmux.sock'), ...args], { encoding: 'utf8' })
  if (r.status !== 0) throw new Error(`tmux ${args[0]}: ${r.stderr || r.status}`)
  return r.stdout
}

scenario(
  'sandbox/connect',
  async () => {
    const id = state.a
    // The pane runs the CLI, then says how it ended and stays for capture-pane.
    const script = join(WORK, 'connect.sh')
    const exports = Object.entries(CLI_ENV)
      .filter(([k]) => /^(E2B_|HOME$|XDG_|NO_COLOR$|FORCE_COLOR$|NODE_|SSL_CERT_|PATH$)/.test(k))
      .map(([k, v]) => `export ${k}='${String(v).replace(/'/g, "'\\''")}'`)
    writeFileSync(
      script,
      [
        ...exports,
        `'${process.execPath}' '${CLI}' sandbox connect ${id}`,
        'echo "CLI-EXIT=$?"',
        'sleep 3600',
        '',
      ].join('\n')
    )
    const session = `cli-${RUN_ID}`
    tmux('new-session', '-d', '-s', session, '-x', '160', '-y', '40', `bash ${script}`)
    state.tmux = session
    const pane = () => tmux('capture-pane', '-p', '-J', '-S', '-200', '-t', session)
    try {
      await waitFor('the CLI to connect', () => pane().includes(`Terminal connecting to sandbox`), {
        timeoutMs: 60_000,
      })
      // The shell's prompt: the pane's last non-empty line ends in "$ " or "# ".
      await waitFor(
        'a shell prompt in the pane',
        () => /[$#]\s*$/.test(pane().trimEnd()),
        { timeoutMs: 60_000 }
      )
      const marker = `m${randomBytes(4).toString('hex')}`
      // The output differs from what was typed ($((6*7)) expands), so seeing it proves the
      // command ran, not merely that the keys were echoed.
      tmux('send-keys', '-t', session, '-l', `echo cli-$((6*7))-${marker} > /tmp/m; cat /tmp/m`)
      tmux('send-keys', '-t', session, 'Enter')
      await waitFor('the command output in the pane', () => pane().includes(`cli-42-${marker}`), {
        timeoutMs: 30_000,
      })
      tmux('send-keys', '-t', session, '-l', 'exit')
      tmux('send-keys', '-t', session, 'Enter')
      const end = await waitFor('the CLI to exit', () => pane().match(/CLI-EXIT=(\d+)/), {
        timeoutMs: 30_000,
      })
      assert.equal(end[1], '0', `sandbox connect exit status; pane:\n${pane()}`)
      assert.match(pane(), /Closing terminal connection to sandbox/, 'the goodbye line')
      // Through the API: the file the typed command wrote.
      const s = await Sandbox.connect(id, sdkOpts)
      assert.equal(await s.files.read('/tmp/m'), `cli-42-${marker}\n`, '/tmp/m in the sandbox')
      for (const l of pane().trimEnd().split('\n')) console.log(`    tmux| ${l}`)
    } catch (e) {
      let shown = ''
      try {
        shown = pane()
      } catch {}
      e.message += `\n---- tmux pane ----\n${shown.trimEnd()}\n----`
      throw e
    }
  },
  { needs: ['sandbox/list'] }
)

scenario(
  'sandbox/kill',
  async () => {
    const r = await cli(['sandbox', 'kill', state.a])
    expectExit(r, 0, 'sandbox kill')
    assert.match(r.out, new RegExp(`Sandbox ${state.a} has been killed`))
    created.delete(state.a)
    const list = await Sandbox.list({ ...sdkOpts, query: { metadata: { conformance: RUN_ID } } })
    const left = (await list.nextItems()).map((x) => x.sandboxId)
    assert.ok(!left.includes(state.a), 'the killed sandbox is still listed')
    assert.ok(left.includes(state.b), 'the other sandbox of this run was killed too')
    const again = await cli(['sandbox', 'kill', state.a])
    expectExit(again, 0, 'sandbox kill (again)')
    assert.match(again.err, new RegExp(`Sandbox ${state.a} wasn't found`))
  },
  { needs: ['sandbox/list'] }
)

scenario(
  'sandbox/kill-all',
  async () => {
    // -a with this run's metadata: the listing scenario showed that the filter holds, so
    // nothing outside this run is touched.
    const r = await cli(['sandbox', 'kill', '-a', '-m', `conformance=${RUN_ID}`])
    expectExit(r, 0, 'sandbox kill -a')
    assert.match(r.out, /Killed 1 running sandboxes/)
    assert.match(r.out, new RegExp(`Sandbox ${state.b} has been killed`))
    created.delete(state.b)
    const after = await cli(['sandbox', 'list', '-m', `conformance=${RUN_ID}`, '-f', 'json'])
    expectExit(after, 0, 'sandbox list')
    assert.deepEqual(jsonOut(after, 'sandbox list'), [], 'sandboxes left after kill -a')
  },
  { needs: ['sandbox/kill'] }
)

scenario(
  'template/delete',
  async () => {
    const r = await cli(['template', 'delete', NAME, '-y'])
    expectExit(r, 0, 'template delete')
    state.deleted = true
    const l = await cli(['template', 'list', '-f', 'json'], { echo: false })
    expectExit(l, 0, 'template list')
    const still = jsonOut(l, 'template list').filter(
      (x) => x.templateID === NAME || (x.aliases || []).includes(NAME)
    )
    assert.deepEqual(still, [], 'the deleted template is still listed')
    // A name that does not exist: the server's 404, as the CLI prints errors.
    const bad = await cli(['template', 'delete', `${NAME}-none`, '-y'])
    assert.notEqual(bad.code, 0, 'deleting an unknown template succeeded')
    assert.match(bad.out + bad.err, /\[404\]/, 'the 404 in the CLI error')
  },
  { needs: ['template/create'] }
)

// ---- runner ----

const filters = process.argv.slice(2)
if (process.env.CONFORMANCE_FILTER) filters.push(...process.env.CONFORMANCE_FILTER.split(','))
const selected = scenarios.filter(
  (s) => filters.length === 0 || filters.some((f) => s.name.includes(f))
)

const cliVersion = spawnSync(process.execPath, [CLI, '--version'], {
  env: CLI_ENV,
  encoding: 'utf8',
})
console.log(
  `e2b CLI ${cliVersion.stdout.trim()} conformance: ` +
    `API ${process.env.E2B_API_URL || '(from domain)'}, ` +
    `${sandboxTarget()}, run ${RUN_ID}`
)

const passed = new Set()
const results = []
for (const s of selected) {
  const t0 = Date.now()
  let error = null
  const missing = s.needs.filter((n) => !passed.has(n))
  if (missing.length) {
    error = new Error(`needs ${missing.join(', ')}, which did not pass in this run`)
  } else {
    console.log(`  ${s.name}`)
    try {
      await withDeadline(Promise.resolve().then(s.fn), s.timeoutMs)
      passed.add(s.name)
    } catch (e) {
      error = e
    }
  }
  const ms = Date.now() - t0
  results.push({ name: s.name, ok: !error, ms })
  console.log(
    `  ${error ? 'FAIL' : 'PASS'} ${s.name} (${ms} ms)` + (error ? `: ${error.message}` : '')
  )
  if (error && process.env.CONFORMANCE_VERBOSE) console.error(error)
}

// Cleanup, passed or not: the tmux server, this run's sandboxes, the template.
const leftovers = []
if (state.tmux) {
  try {
    tmux('kill-server')
  } catch {}
}
for (const id of created) {
  try {
    await Sandbox.kill(id, { requestTimeoutMs: 60_000 * MULT })
  } catch (e) {
    leftovers.push(`sandbox ${id}: ${e.message}`)
  }
}
if (state.built && !state.deleted) {
  const r = await cli(['template', 'delete', NAME, '-y'], { echo: false })
  if (r.code !== 0) leftovers.push(`template ${NAME}: ${r.err.trim().slice(-200)}`)
}
rmSync(WORK, { recursive: true, force: true })

const w = Math.max(8, ...results.map((r) => r.name.length))
console.log(`\n${'scenario'.padEnd(w)} | result | ms`)
for (const r of results) {
  console.log(`${r.name.padEnd(w)} | ${r.ok ? 'PASS  ' : 'FAIL  '} | ${r.ms}`)
}
for (const l of leftovers) console.error(`conformance.cli: cleanup: ${l}`)
const failed = results.filter((r) => !r.ok).length
console.log(`\n${results.length - failed} passed, ${failed} failed`)
process.exit(failed || leftovers.length ? 1 : 0)
