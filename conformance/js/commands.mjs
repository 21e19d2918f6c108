// commands.mjs - sandbox.commands and sandbox.pty through envd's process service: run,
// non-zero exit, streaming, background + wait, stdin, kill, connect by pid, list, env, cwd,
// user, command timeout, PTY. All scenarios share one sandbox.
import assert from 'node:assert/strict'
import {
  AuthenticationError,
  CommandExitError,
  NotFoundError,
  TimeoutError,
} from 'e2b'
import { RUN_ID, rejectsWith, scenario, sharedSandbox, waitFor } from './lib.mjs'

const A = 'commands'
const sandbox = sharedSandbox({ metadata: { group: 'commands' }, envs: { SBX_ENV: 'from-create' } })
const enc = new TextEncoder()
const dec = new TextDecoder()

scenario(A, 'run', async () => {
  const sbx = await sandbox()
  const r = await sbx.commands.run('echo hello; echo to-stderr >&2')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello\n')
  assert.equal(r.stderr, 'to-stderr\n')
  // Binary-unsafe output survives the base64 round trip as UTF-8.
  const u = await sbx.commands.run("printf 'ünïcødé ✓\\n'")
  assert.equal(u.stdout, 'ünïcødé ✓\n')
  // Larger output arrives whole and in order.
  const big = await sbx.commands.run('seq 1 20000')
  const lines = big.stdout.trimEnd().split('\n')
  assert.equal(lines.length, 20000)
  assert.equal(lines[19999], '20000')
})

scenario(A, 'non-zero exit', async () => {
  const sbx = await sandbox()
  const err = await rejectsWith(
    sbx.commands.run('echo partial; echo broken >&2; exit 3'),
    CommandExitError,
    'exit 3'
  )
  assert.equal(err.exitCode, 3)
  assert.equal(err.stdout, 'partial\n')
  assert.equal(err.stderr, 'broken\n')
  const missing = await rejectsWith(sbx.commands.run('no-such-command-' + RUN_ID), CommandExitError)
  assert.equal(missing.exitCode, 127)
  assert.match(missing.stderr, /not found/)
})

scenario(A, 'output streams while the command runs', async () => {
  const sbx = await sandbox()
  const chunks = []
  const t0 = Date.now()
  const r = await sbx.commands.run('for i in 1 2 3; do echo line $i; sleep 0.5; done', {
    onStdout: (d) => chunks.push({ d, at: Date.now() - t0 }),
  })
  assert.equal(chunks.map((c) => c.d).join(''), 'line 1\nline 2\nline 3\n')
  assert.equal(r.stdout, 'line 1\nline 2\nline 3\n')
  assert.ok(chunks.length >= 2, `output came in ${chunks.length} chunk(s): not streamed`)
  const spread = chunks[chunks.length - 1].at - chunks[0].at
  assert.ok(spread >= 500, `first and last chunk ${spread} ms apart: output was buffered`)
})

scenario(A, 'background + wait', async () => {
  const sbx = await sandbox()
  const t0 = Date.now()
  const h = await sbx.commands.run('sleep 1.5; echo done; exit 0', { background: true })
  const started = Date.now() - t0
  assert.ok(Number.isInteger(h.pid) && h.pid > 0, `pid ${h.pid}`)
  assert.equal(h.exitCode, undefined, 'still running right after start')
  const listed = await sbx.commands.list()
  const me = listed.find((p) => p.pid === h.pid)
  assert.ok(me, `pid ${h.pid} in commands.list()`)
  assert.equal(me.cmd, '/bin/bash')
  assert.deepEqual(me.args, ['-l', '-c', 'sleep 1.5; echo done; exit 0'])
  const r = await h.wait()
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'done\n')
  assert.ok(Date.now() - t0 >= 1500, 'wait() waited for the command')
  assert.ok(started < Date.now() - t0 - 1000, `run() returned after ${started} ms, not at the end`)
  // Background failure surfaces at wait().
  const bad = await sbx.commands.run('sleep 0.2; exit 4', { background: true })
  const err = await rejectsWith(bad.wait(), CommandExitError)
  assert.equal(err.exitCode, 4)
})

scenario(A, 'stdin', async () => {
  const sbx = await sandbox()
  // Without stdin: true the command reads end-of-file at once instead of hanging.
  const closed = await sbx.commands.run('cat; echo eof', { timeoutMs: 30_000 })
  assert.equal(closed.stdout, 'eof\n')

  let out = ''
  const h = await sbx.commands.run('cat', { background: true, stdin: true, onStdout: (d) => (out += d) })
  await sbx.commands.sendStdin(h.pid, 'first line\n')
  await waitFor('cat to echo the first line', async () => out === 'first line\n')
  await sbx.commands.sendStdin(h.pid, enc.encode('bytes ✓\n'))
  await waitFor('cat to echo the second line', async () => out === 'first line\nbytes ✓\n')
  await sbx.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'first line\nbytes ✓\n')
  await rejectsWith(sbx.commands.sendStdin(h.pid, 'late'), NotFoundError, 'stdin to an exited process')
})

scenario(A, 'kill', async () => {
  const sbx = await sandbox()
  const h = await sbx.commands.run('sleep 600', { background: true })
  assert.equal(await sbx.commands.kill(h.pid), true)
  const err = await rejectsWith(h.wait(), CommandExitError, 'wait() after kill')
  assert.notEqual(err.exitCode, 0)
  await waitFor('the killed pid to leave the list', async () =>
    !(await sbx.commands.list()).some((p) => p.pid === h.pid)
  )
  assert.equal(await sbx.commands.kill(h.pid), false, 'killing it again: not found')
  // The handle's own kill().
  const h2 = await sbx.commands.run('sleep 600', { background: true })
  assert.equal(await h2.kill(), true)
  await rejectsWith(h2.wait(), CommandExitError)
})

scenario(A, 'connect by pid', async () => {
  const sbx = await sandbox()
  let first = ''
  const h = await sbx.commands.run('for i in $(seq 1 200); do echo tick $i; sleep 0.2; done', {
    background: true,
    onStdout: (d) => (first += d),
  })
  await waitFor('ticks', async () => first.includes('tick 2\n'))
  await h.disconnect()
  // Disconnecting does not stop the process.
  assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid), 'still running after disconnect')
  let again = ''
  const h2 = await sbx.commands.connect(h.pid, { onStdout: (d) => (again += d) })
  assert.equal(h2.pid, h.pid)
  const lastBefore = Math.max(...[...first.matchAll(/tick (\d+)/g)].map((m) => Number(m[1])))
  await waitFor('new ticks on the re-attached stream', async () =>
    [...again.matchAll(/tick (\d+)/g)].some((m) => Number(m[1]) > lastBefore)
  )
  assert.equal(await h2.kill(), true)
  await rejectsWith(h2.wait(), CommandExitError)
  // envd forgets a process once it has exited: re-attaching is not_found (allow it a moment).
  await waitFor('connect to the exited pid to be not found', async () => {
    const e = await sbx.commands.connect(h.pid).then(
      async (late) => (await late.kill(), null),
      (err) => err
    )
    if (e && !(e instanceof NotFoundError)) throw e
    return e instanceof NotFoundError
  }, { timeoutMs: 10_000, intervalMs: 500 })
})

scenario(A, 'env', async () => {
  const sbx = await sandbox()
  const r = await sbx.commands.run('echo "$ONE|$TWO|$SBX_ENV"', { envs: { ONE: '1', TWO: 'two words' } })
  assert.equal(r.stdout, '1|two words|from-create\n')
  const over = await sbx.commands.run('echo $SBX_ENV', { envs: { SBX_ENV: 'overridden' } })
  assert.equal(over.stdout, 'overridden\n')
  const listed = await sbx.commands.run('sleep 5', { background: true, envs: { LISTED: 'yes' } })
  const me = (await sbx.commands.list()).find((p) => p.pid === listed.pid)
  assert.equal(me?.envs?.LISTED, 'yes', `list() reports the command's envs: ${JSON.stringify(me)}`)
  await listed.kill()
})

scenario(A, 'cwd', async () => {
  const sbx = await sandbox()
  assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
  assert.equal((await sbx.commands.run('pwd')).stdout, '/home/user\n', 'default cwd: the user home')
  await rejectsWith(sbx.commands.run('pwd', { cwd: '/no/such/dir' + RUN_ID }), Error, 'missing cwd')
})

scenario(A, 'user', async () => {
  const sbx = await sandbox()
  assert.equal((await sbx.commands.run('whoami')).stdout, 'user\n', 'default user')
  const root = await sbx.commands.run('whoami; echo $HOME; pwd', { user: 'root' })
  assert.equal(root.stdout, 'root\n/root\n/root\n')
  const u = await sbx.commands.run('id -un; echo $HOME', { user: 'user' })
  assert.equal(u.stdout, 'user\n/home/user\n')
  await rejectsWith(sbx.commands.run('true', { user: 'nosuchuser' + RUN_ID }), AuthenticationError, 'unknown user')
})

scenario(A, 'command timeout kills the process', async () => {
  const sbx = await sandbox()
  const marker = `sleep 37.${Date.now() % 1000}`
  const t0 = Date.now()
  await rejectsWith(sbx.commands.run(marker, { timeoutMs: 2_000 }), TimeoutError)
  assert.ok(Date.now() - t0 < 30_000, 'the timeout was honoured')
  // envd runs the process under the deadline: it must be gone, not orphaned.
  await waitFor('the timed-out process to be gone', async () =>
    !(await sbx.commands.list()).some((p) => p.args.join(' ').includes(marker))
  )
  const ps = await sbx.commands.run(`pgrep -f '${marker}' || true`)
  assert.equal(ps.stdout.trim(), '', 'no process left behind')
})

scenario(A, 'pty', async () => {
  const sbx = await sandbox()
  let out = ''
  const term = await sbx.pty.create({ cols: 100, rows: 30, onData: (d) => (out += dec.decode(d)), timeoutMs: 120_000 })
  assert.ok(term.pid > 0)
  await sbx.pty.sendInput(term.pid, enc.encode('stty size; tty; echo $TERM; echo pty-$((6*7))\n'))
  await waitFor('the PTY to answer', async () => out.includes('pty-42'), { timeoutMs: 60_000 })
  assert.match(out, /30 100/, 'stty sees the requested size')
  assert.match(out, /\/dev\/pts\/\d+/, 'a real terminal')
  assert.match(out, /xterm-256color/)
  await sbx.pty.resize(term.pid, { cols: 120, rows: 40 })
  await sbx.pty.sendInput(term.pid, enc.encode('stty size\n'))
  await waitFor('the new size', async () => out.includes('40 120'))
  await sbx.pty.sendInput(term.pid, enc.encode('exit 0\n'))
  const r = await term.wait()
  assert.equal(r.exitCode, 0)
  // A second PTY is killed instead.
  const t2 = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} })
  assert.equal(await sbx.pty.kill(t2.pid), true)
  await rejectsWith(t2.wait(), CommandExitError)
})
