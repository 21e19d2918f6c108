// lifecycle.mjs - the control plane through the SDK: create, connect, list (metadata filter,
// pagination), getInfo, setTimeout and expiry, pause + connect (resume) with state intact,
// kill, and the error cases (unknown sandbox, bad API key, bad envd token).
import assert from 'node:assert/strict'
import {
  AuthenticationError,
  CommandExitError,
  Sandbox,
  SandboxError,
  SandboxNotFoundError,
} from 'e2b'
import {
  MULT,
  REQUEST_TIMEOUT_MS,
  RUN_ID,
  TEMPLATE,
  forget,
  newSandbox,
  rejectsWith,
  scenario,
  waitFor,
} from './lib.mjs'

const A = 'lifecycle'
const api = { requestTimeoutMs: REQUEST_TIMEOUT_MS }
// An id of the right shape that no server has issued.
const UNKNOWN_ID = 'nosuchsandbox' + RUN_ID

let main // the sandbox most scenarios here look at
const mainPromise = () =>
  (main ??= newSandbox({ metadata: { group: 'main', purpose: 'lifecycle' }, envs: { LC: 'yes' } }))

scenario(A, 'create', async () => {
  const t0 = Date.now()
  const sbx = await mainPromise()
  assert.match(sbx.sandboxId, /^[a-z0-9]+$/, 'sandbox ids are lowercase alphanumerics (host routing)')
  // Without a domain in the response the SDK would aim sandbox hosts at E2B's cloud.
  assert.ok(sbx.sandboxDomain, 'create must return a domain')
  assert.notEqual(sbx.sandboxDomain, 'e2b.app')
  assert.equal(sbx.getHost(8080), `8080-${sbx.sandboxId}.${sbx.sandboxDomain}`)
  assert.equal(await sbx.isRunning(), true)
  const r = await sbx.commands.run('echo ready:$LC')
  assert.equal(r.stdout, 'ready:yes\n')
  console.log(`    (create + first command: ${Date.now() - t0} ms)`)
})

scenario(A, 'connect by id to a running sandbox', async () => {
  const sbx = await mainPromise()
  const other = await Sandbox.connect(sbx.sandboxId, api)
  assert.equal(other.sandboxId, sbx.sandboxId)
  const r = await other.commands.run('echo via-connect')
  assert.equal(r.stdout, 'via-connect\n')
  // Files written through one object are visible through the other.
  await other.files.write('/tmp/connected.txt', 'one sandbox')
  assert.equal(await sbx.files.read('/tmp/connected.txt'), 'one sandbox')
})

scenario(A, 'getInfo', async () => {
  const sbx = await mainPromise()
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.ok(info.templateId === TEMPLATE || info.name === TEMPLATE, `template: ${info.templateId} / ${info.name}`)
  assert.equal(info.state, 'running')
  assert.deepEqual(info.metadata, { conformance: RUN_ID, group: 'main', purpose: 'lifecycle' })
  assert.ok(info.startedAt instanceof Date && !isNaN(info.startedAt), 'startedAt parses')
  assert.ok(info.endAt instanceof Date && !isNaN(info.endAt), 'endAt parses')
  const ttl = (info.endAt - info.startedAt) / 1000
  assert.ok(ttl > 800 && ttl < 1000, `endAt - startedAt = ${ttl} s, created with 900 s`)
  assert.ok(Math.abs(info.startedAt - Date.now()) < 600_000 * MULT, 'startedAt is recent')
  assert.ok(Number.isInteger(info.cpuCount) && info.cpuCount > 0, `cpuCount ${info.cpuCount}`)
  assert.ok(Number.isInteger(info.memoryMB) && info.memoryMB > 0, `memoryMB ${info.memoryMB}`)
  assert.match(info.envdVersion, /^\d+\.\d+\.\d+/)
  // The static form answers the same.
  const again = await Sandbox.getInfo(sbx.sandboxId, api)
  assert.equal(again.sandboxId, sbx.sandboxId)
  assert.equal(again.state, 'running')
})

scenario(A, 'list with metadata filter and pagination', async () => {
  const sbx = await mainPromise()
  // Keys and values that need the SDK's double encoding to survive (spec 2.5).
  const odd = { 'odd key': 'a&b=c d/é%' }
  const a = await newSandbox({ metadata: { group: 'list', ...odd } })
  const b = await newSandbox({ metadata: { group: 'list', ...odd } })
  const want = [a.sandboxId, b.sandboxId].sort()

  const seen = []
  const pager = Sandbox.list({ ...api, query: { metadata: { conformance: RUN_ID, group: 'list' } }, limit: 1 })
  let pages = 0
  while (pager.hasNext && pages < 10) {
    const items = await pager.nextItems()
    pages++
    assert.ok(items.length <= 1, `limit 1 gave a page of ${items.length}`)
    for (const it of items) {
      assert.equal(it.metadata.group, 'list')
      assert.equal(it.state, 'running')
      assert.ok(it.startedAt instanceof Date && !isNaN(it.startedAt))
      seen.push(it.sandboxId)
    }
  }
  assert.deepEqual(seen.sort(), want, 'both list sandboxes, each once, nothing else')
  assert.ok(pages >= 2, `two matches with limit 1 take at least two pages, got ${pages}`)

  // The odd key/value filters by itself too.
  const byOdd = await Sandbox.list({ ...api, query: { metadata: { conformance: RUN_ID, ...odd } } }).nextItems()
  assert.deepEqual(byOdd.map((s) => s.sandboxId).sort(), want)
  // The whole run, without limit: main + the two.
  const all = await Sandbox.list({ ...api, query: { metadata: { conformance: RUN_ID } } }).nextItems()
  for (const id of [sbx.sandboxId, ...want]) assert.ok(all.some((s) => s.sandboxId === id), `${id} listed`)
  // A filter that matches nothing.
  const none = await Sandbox.list({ ...api, query: { metadata: { conformance: RUN_ID, group: 'nope' } } }).nextItems()
  assert.deepEqual(none, [])

  await a.kill()
  await b.kill()
  forget(a.sandboxId)
  forget(b.sandboxId)
  const after = await Sandbox.list({ ...api, query: { metadata: { conformance: RUN_ID, group: 'list' } } }).nextItems()
  assert.deepEqual(after, [], 'killed sandboxes leave the list')
})

scenario(A, 'setTimeout', async () => {
  const sbx = await mainPromise()
  await sbx.setTimeout(1_800_000)
  let info = await sbx.getInfo()
  let left = (info.endAt - Date.now()) / 1000
  assert.ok(left > 1700 && left < 1900, `after setTimeout(30 min) endAt is ${left} s away`)
  // Shortening is allowed too (the timeout endpoint sets, connect only extends).
  await Sandbox.setTimeout(sbx.sandboxId, 600_000, api)
  info = await sbx.getInfo()
  left = (info.endAt - Date.now()) / 1000
  assert.ok(left > 500 && left < 700, `after setTimeout(10 min) endAt is ${left} s away`)
})

scenario(A, 'expiry kills the sandbox', async () => {
  const sbx = await newSandbox({ metadata: { group: 'expiry' } })
  await sbx.setTimeout(3_000)
  const info = await sbx.getInfo()
  assert.ok(info.endAt - Date.now() < 10_000, 'endAt moved to about now + 3 s')
  await waitFor(
    'the expired sandbox to be gone',
    async () => {
      try {
        await Sandbox.getInfo(sbx.sandboxId, api)
        return false
      } catch (e) {
        if (e instanceof SandboxNotFoundError) return true
        throw e
      }
    },
    { timeoutMs: 90_000, intervalMs: 1000 }
  )
  forget(sbx.sandboxId)
  assert.equal(await sbx.isRunning(), false)
  const listed = await Sandbox.list({ ...api, query: { metadata: { conformance: RUN_ID, group: 'expiry' } } }).nextItems()
  assert.deepEqual(listed, [])
})

scenario(
  A,
  'pause then connect keeps files and processes',
  async () => {
    const sbx = await newSandbox({ metadata: { group: 'pause' } })
    await sbx.files.write('/home/user/persist.txt', 'kept across pause')
    // A counter that must keep counting after resume, with no deadline (timeoutMs 0).
    const bg = await sbx.commands.run(
      'i=0; while true; do i=$((i+1)); echo $i > /home/user/counter; echo tick $i; sleep 0.5; done',
      { background: true, timeoutMs: 0 }
    )
    await waitFor('the counter to start', async () => Number(await sbx.files.read('/home/user/counter')) > 1)
    await bg.disconnect()

    assert.equal(await sbx.pause(), true, 'pause of a running sandbox returns true')
    const paused = await Sandbox.getInfo(sbx.sandboxId, api)
    assert.equal(paused.state, 'paused')
    const listedPaused = await Sandbox.list({
      ...api,
      query: { metadata: { conformance: RUN_ID, group: 'pause' }, state: ['paused'] },
    }).nextItems()
    assert.deepEqual(listedPaused.map((s) => s.sandboxId), [sbx.sandboxId])
    const listedRunning = await Sandbox.list({
      ...api,
      query: { metadata: { conformance: RUN_ID, group: 'pause' }, state: ['running'] },
    }).nextItems()
    assert.deepEqual(listedRunning, [])
    assert.equal(await sbx.isRunning(), false, 'isRunning while paused')
    assert.equal(await Sandbox.pause(sbx.sandboxId, api), false, 'pausing a paused sandbox returns false (409)')

    // Resume through the class method: a new object, routed by its access token.
    const resumed = await Sandbox.connect(sbx.sandboxId, api)
    assert.equal((await resumed.getInfo()).state, 'running')
    assert.equal(await resumed.files.read('/home/user/persist.txt'), 'kept across pause')
    const procs = await resumed.commands.list()
    assert.ok(procs.some((p) => p.pid === bg.pid), `pid ${bg.pid} still listed: ${JSON.stringify(procs.map((p) => p.pid))}`)
    // The loop's `echo $i > counter` truncates before it writes, and the pause may have
    // caught it in between: the file is empty until the loop moves on
    let before = NaN
    await waitFor('the counter readable after resume', async () => {
      const text = (await resumed.files.read('/home/user/counter')).trim()
      before = text === '' ? NaN : Number(text)
      return !Number.isNaN(before)
    })
    await waitFor(
      'the counter to move after resume',
      async () => Number(await resumed.files.read('/home/user/counter')) > before
    )
    // Re-attach to the process that lived through the pause.
    let out = ''
    const h = await resumed.commands.connect(bg.pid, { onStdout: (d) => (out += d) })
    await waitFor('output from the re-attached process', async () => /tick \d+/.test(out))
    // The original object still works after connect() (its access token did not change).
    await sbx.connect(api)
    assert.equal((await sbx.commands.run('cat /home/user/persist.txt')).stdout, 'kept across pause')
    assert.equal(await resumed.commands.kill(bg.pid), true)
    await rejectsWith(h.wait(), CommandExitError, 'killed process wait()')
    await sbx.kill()
    forget(sbx.sandboxId)
  },
  { timeoutMs: 300_000 }
)

scenario(A, 'kill', async () => {
  const sbx = await newSandbox({ metadata: { group: 'kill' } })
  await sbx.kill()
  forget(sbx.sandboxId)
  await rejectsWith(Sandbox.getInfo(sbx.sandboxId, api), SandboxNotFoundError, 'getInfo after kill')
  assert.equal(await Sandbox.kill(sbx.sandboxId, api), false, 'second kill returns false (404)')
  assert.equal(await sbx.isRunning(), false, 'isRunning after kill')
  await rejectsWith(Sandbox.connect(sbx.sandboxId, api), SandboxNotFoundError, 'connect after kill')
})

scenario(A, 'errors: unknown sandbox', async () => {
  await rejectsWith(Sandbox.connect(UNKNOWN_ID, api), SandboxNotFoundError, 'connect')
  await rejectsWith(Sandbox.getInfo(UNKNOWN_ID, api), SandboxNotFoundError, 'getInfo')
  await rejectsWith(Sandbox.setTimeout(UNKNOWN_ID, 60_000, api), SandboxNotFoundError, 'setTimeout')
  await rejectsWith(Sandbox.pause(UNKNOWN_ID, api), SandboxNotFoundError, 'pause')
  assert.equal(await Sandbox.kill(UNKNOWN_ID, api), false, 'kill of an unknown sandbox returns false')
})

scenario(A, 'errors: unknown template', async () => {
  const err = await rejectsWith(
    Sandbox.create('no-such-template-' + RUN_ID, { ...api, metadata: { conformance: RUN_ID } }),
    SandboxError,
    'create from a missing template'
  )
  assert.match(err.message, /^4\d\d: /, `a client error status: ${err.message}`)
  // An E2B error body {"code": int, "message": str}: otherwise the SDK prints the object.
  assert.doesNotMatch(err.message, /\[object Object\]|undefined/, 'the error body carries a message')
})

scenario(A, 'errors: bad API key', async () => {
  const bad = { ...api, apiKey: 'e2b_' + '0'.repeat(40) }
  await rejectsWith(Sandbox.create(TEMPLATE, { ...bad, metadata: { conformance: RUN_ID } }), AuthenticationError, 'create')
  await rejectsWith(Sandbox.list(bad).nextItems(), AuthenticationError, 'list')
  const sbx = await mainPromise()
  await rejectsWith(Sandbox.getInfo(sbx.sandboxId, bad), AuthenticationError, 'getInfo')
  await rejectsWith(Sandbox.kill(sbx.sandboxId, bad), AuthenticationError, 'kill')
  await rejectsWith(Sandbox.connect(sbx.sandboxId, bad), AuthenticationError, 'connect')
  // Nothing happened to the sandbox.
  assert.equal((await sbx.getInfo()).state, 'running')
})

scenario(A, 'errors: wrong envd access token', async () => {
  const sbx = await mainPromise()
  const info = await sbx.getInfo()
  // What an SDK object holding a stale or forged token sends: the right sandbox id header,
  // the wrong X-Access-Token.
  const forged = new Sandbox({
    sandboxId: sbx.sandboxId,
    sandboxDomain: sbx.sandboxDomain,
    envdVersion: info.envdVersion,
    envdAccessToken: 'forged-' + RUN_ID,
    requestTimeoutMs: REQUEST_TIMEOUT_MS,
  })
  await rejectsWith(forged.commands.run('echo should-not-run'), AuthenticationError, 'commands.run')
  await rejectsWith(forged.files.read('/etc/hostname'), AuthenticationError, 'files.read')
  await rejectsWith(forged.files.write('/tmp/forged', 'x'), AuthenticationError, 'files.write')
  assert.equal(await sbx.files.exists('/tmp/forged'), false)
})

// Last: the shared sandbox goes, so the kill path is also covered for an object in use.
scenario(A, 'kill the main sandbox', async () => {
  const sbx = await mainPromise()
  await sbx.kill()
  forget(sbx.sandboxId)
  await rejectsWith(sbx.getInfo(), SandboxNotFoundError, 'getInfo after kill')
})
