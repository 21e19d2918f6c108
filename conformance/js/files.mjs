// files.mjs - sandbox.files through envd's /files and filesystem service: write, read as
// text/bytes/blob/stream, multi-file writes, list with depth, exists, getInfo, rename,
// makeDir, remove, watch, a 20 MiB upload, and the error mapping. One shared sandbox.
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import {
  FileNotFoundError,
  FilesystemEventType,
  InvalidArgumentError,
} from 'e2b'
import { rejectsWith, scenario, sha256, sharedSandbox, sleep, waitFor } from './lib.mjs'

const A = 'files'
const sandbox = sharedSandbox({ metadata: { group: 'files' } })
const H = '/home/user'

scenario(A, 'write and read text', async () => {
  const sbx = await sandbox()
  const text = 'héllo wörld ✓\nsecond line\n'
  const info = await sbx.files.write(`${H}/hello.txt`, text)
  assert.deepEqual(
    { name: info.name, path: info.path, type: info.type },
    { name: 'hello.txt', path: `${H}/hello.txt`, type: 'file' }
  )
  assert.equal(await sbx.files.read(`${H}/hello.txt`), text)
  // The file is really in the guest, as the default user.
  const r = await sbx.commands.run(`cat ${H}/hello.txt; stat -c %U ${H}/hello.txt`)
  assert.equal(r.stdout, text + 'user\n')
  // Overwrite truncates.
  await sbx.files.write(`${H}/hello.txt`, 'short')
  assert.equal(await sbx.files.read(`${H}/hello.txt`), 'short')
  // Empty file.
  await sbx.files.write(`${H}/empty.txt`, '')
  assert.equal(await sbx.files.read(`${H}/empty.txt`), '')
  // Relative paths resolve against the user's home; parents are created.
  const rel = await sbx.files.write('rel/dir/r.txt', 'relative')
  assert.equal(rel.path, `${H}/rel/dir/r.txt`)
  assert.equal(await sbx.files.read(`${H}/rel/dir/r.txt`), 'relative')
  assert.equal((await sbx.files.getInfo(`${H}/rel/dir`)).owner, 'user', 'created parents belong to the user')
  // As root, into root's home.
  const asRoot = await sbx.files.write('/root/by-root.txt', 'r', { user: 'root' })
  assert.equal(asRoot.path, '/root/by-root.txt')
  assert.equal((await sbx.files.getInfo('/root/by-root.txt', { user: 'root' })).owner, 'root')
})

scenario(A, 'read bytes, blob and stream', async () => {
  const sbx = await sandbox()
  const all = new Uint8Array(256 * 4).map((_, i) => i % 256)
  await sbx.files.write(`${H}/all-bytes.bin`, all.buffer)
  const bytes = await sbx.files.read(`${H}/all-bytes.bin`, { format: 'bytes' })
  assert.ok(bytes instanceof Uint8Array)
  assert.deepEqual(Buffer.from(bytes), Buffer.from(all))
  const blob = await sbx.files.read(`${H}/all-bytes.bin`, { format: 'blob' })
  assert.deepEqual(Buffer.from(await blob.arrayBuffer()), Buffer.from(all))

  const payload = randomBytes(3 << 20)
  // Upload from a ReadableStream of several chunks, download as a stream.
  const src = new ReadableStream({
    start(c) {
      for (let off = 0; off < payload.length; off += 1 << 20) c.enqueue(payload.subarray(off, off + (1 << 20)))
      c.close()
    },
  })
  await sbx.files.write(`${H}/streamed.bin`, src)
  const stream = await sbx.files.read(`${H}/streamed.bin`, { format: 'stream' })
  const parts = []
  for await (const part of stream) parts.push(Buffer.from(part))
  const got = Buffer.concat(parts)
  assert.equal(got.length, payload.length)
  assert.equal(sha256(got), sha256(payload))
  // gzip on the way down is transparent.
  const gz = await sbx.files.read(`${H}/streamed.bin`, { format: 'bytes', gzip: true })
  assert.equal(sha256(Buffer.from(gz)), sha256(payload))
})

scenario(A, 'octet-stream and gzip uploads', async () => {
  const sbx = await sandbox()
  const data = 'octet ✓ '.repeat(1000)
  const info = await sbx.files.write(`${H}/octet.txt`, data, { useOctetStream: true })
  assert.equal(info.path, `${H}/octet.txt`)
  assert.equal(await sbx.files.read(`${H}/octet.txt`), data)
  await sbx.files.write(`${H}/gz.txt`, data, { useOctetStream: true, gzip: true })
  assert.equal(await sbx.files.read(`${H}/gz.txt`), data, 'the server gunzips Content-Encoding: gzip')
})

scenario(A, 'write several files at once', async () => {
  const sbx = await sandbox()
  const infos = await sbx.files.write([
    { path: '/tmp/multi/a.txt', data: 'A' },
    { path: '/tmp/multi/b/c.txt', data: 'C' },
    { path: `${H}/multi-d.txt`, data: new TextEncoder().encode('D').buffer },
  ])
  assert.deepEqual(infos.map((i) => i.path).sort(), ['/home/user/multi-d.txt', '/tmp/multi/a.txt', '/tmp/multi/b/c.txt'])
  assert.equal(await sbx.files.read('/tmp/multi/a.txt'), 'A')
  assert.equal(await sbx.files.read('/tmp/multi/b/c.txt'), 'C')
  assert.equal(await sbx.files.read(`${H}/multi-d.txt`), 'D')
})

scenario(A, 'list with depth', async () => {
  const sbx = await sandbox()
  const root = `${H}/tree`
  await sbx.files.write([
    { path: `${root}/a.txt`, data: '12345' },
    { path: `${root}/sub/b.txt`, data: 'b' },
    { path: `${root}/sub/deeper/c.txt`, data: 'c' },
  ])
  const one = await sbx.files.list(root)
  assert.deepEqual(one.map((e) => `${e.name}:${e.type}`).sort(), ['a.txt:file', 'sub:dir'])
  const a = one.find((e) => e.name === 'a.txt')
  assert.equal(a.path, `${root}/a.txt`)
  assert.equal(a.size, 5)
  assert.equal(a.owner, 'user')
  assert.match(a.permissions, /^-[rwx-]{9}$/)
  assert.ok(a.modifiedTime instanceof Date && Math.abs(a.modifiedTime - Date.now()) < 3_600_000, 'mtime is recent')
  const two = await sbx.files.list(root, { depth: 2 })
  assert.deepEqual(
    two.map((e) => e.path).sort(),
    [`${root}/a.txt`, `${root}/sub`, `${root}/sub/b.txt`, `${root}/sub/deeper`]
  )
  const three = await sbx.files.list(root, { depth: 3 })
  assert.ok(three.some((e) => e.path === `${root}/sub/deeper/c.txt`))
  await rejectsWith(sbx.files.list(`${root}/missing`), FileNotFoundError, 'list of a missing dir')
  await rejectsWith(sbx.files.list(root, { depth: 0 }), InvalidArgumentError, 'depth 0 (client-side)')
})

scenario(A, 'exists and getInfo', async () => {
  const sbx = await sandbox()
  await sbx.files.write(`${H}/ex/file.txt`, 'x')
  assert.equal(await sbx.files.exists(`${H}/ex/file.txt`), true)
  assert.equal(await sbx.files.exists(`${H}/ex`), true)
  assert.equal(await sbx.files.exists(`${H}/ex/nope.txt`), false)
  const f = await sbx.files.getInfo(`${H}/ex/file.txt`)
  assert.equal(f.type, 'file')
  assert.equal(f.size, 1)
  const d = await sbx.files.getInfo(`${H}/ex`)
  assert.equal(d.type, 'dir')
  assert.equal(d.name, 'ex')
  await sbx.commands.run(`ln -sf ${H}/ex/file.txt ${H}/ex/link`)
  const l = await sbx.files.getInfo(`${H}/ex/link`)
  assert.equal(l.symlinkTarget, `${H}/ex/file.txt`)
  await rejectsWith(sbx.files.getInfo(`${H}/ex/nope.txt`), FileNotFoundError)
})

scenario(A, 'rename', async () => {
  const sbx = await sandbox()
  await sbx.files.write(`${H}/mv/old.txt`, 'moving')
  const info = await sbx.files.rename(`${H}/mv/old.txt`, `${H}/mv/new.txt`)
  assert.equal(info.path, `${H}/mv/new.txt`)
  assert.equal(info.name, 'new.txt')
  assert.equal(await sbx.files.exists(`${H}/mv/old.txt`), false)
  assert.equal(await sbx.files.read(`${H}/mv/new.txt`), 'moving')
  // Directories move with their contents.
  await sbx.files.rename(`${H}/mv`, `${H}/moved`)
  assert.equal(await sbx.files.read(`${H}/moved/new.txt`), 'moving')
  await rejectsWith(sbx.files.rename(`${H}/nope-src`, `${H}/nope-dst`), FileNotFoundError)
})

scenario(A, 'makeDir', async () => {
  const sbx = await sandbox()
  assert.equal(await sbx.files.makeDir(`${H}/made/x/y`), true, 'creates parents too')
  assert.equal(await sbx.files.makeDir(`${H}/made/x/y`), false, 'already there')
  const info = await sbx.files.getInfo(`${H}/made/x/y`)
  assert.equal(info.type, 'dir')
  assert.equal(info.owner, 'user')
})

scenario(A, 'remove', async () => {
  const sbx = await sandbox()
  await sbx.files.write(`${H}/rm/one.txt`, '1')
  await sbx.files.write(`${H}/rm/sub/two.txt`, '2')
  await sbx.files.remove(`${H}/rm/one.txt`)
  assert.equal(await sbx.files.exists(`${H}/rm/one.txt`), false)
  await sbx.files.remove(`${H}/rm`) // a non-empty directory goes whole
  assert.equal(await sbx.files.exists(`${H}/rm`), false)
  await rejectsWith(sbx.files.remove(`${H}/rm`), FileNotFoundError, 'removing a missing path')
})

scenario(A, 'read errors', async () => {
  const sbx = await sandbox()
  await rejectsWith(sbx.files.read(`${H}/missing-file.txt`), FileNotFoundError, 'missing file')
  await rejectsWith(sbx.files.read(H), InvalidArgumentError, 'reading a directory')
  await sbx.files.write(`${H}/a-dir-here/x`, 'x')
  await rejectsWith(sbx.files.write(`${H}/a-dir-here`, 'y'), InvalidArgumentError, 'writing over a directory')
})

scenario(A, 'watch', async () => {
  const sbx = await sandbox()
  const dir = `${H}/watched`
  await sbx.files.makeDir(dir)
  const events = []
  const w = await sbx.files.watchDir(dir, (e) => events.push(e), { timeoutMs: 120_000 })
  const has = (name, type) => {
    if (events.some((e) => e.name === name && e.type === type)) return true
    throw new Error(`events so far: ${JSON.stringify(events)}`)
  }
  await sbx.files.write(`${dir}/w1.txt`, 'first')
  await waitFor('create of w1.txt', async () => has('w1.txt', FilesystemEventType.CREATE))
  await sbx.commands.run(`echo more >> ${dir}/w1.txt`)
  await waitFor('write of w1.txt', async () => has('w1.txt', FilesystemEventType.WRITE))
  await sbx.files.rename(`${dir}/w1.txt`, `${dir}/w2.txt`)
  await waitFor('rename of w1.txt', async () => has('w1.txt', FilesystemEventType.RENAME))
  await sbx.files.remove(`${dir}/w2.txt`)
  await waitFor('remove of w2.txt', async () => has('w2.txt', FilesystemEventType.REMOVE))
  await w.stop()
  const n = events.length
  await sbx.files.write(`${dir}/after-stop.txt`, 'x')
  await sleep(1000)
  assert.equal(events.length, n, 'no events after stop()')

  // Recursive: names are relative to the watched directory.
  await sbx.files.makeDir(`${dir}/sub`)
  const rec = []
  const wr = await sbx.files.watchDir(dir, (e) => rec.push(e), { recursive: true, timeoutMs: 120_000 })
  await sbx.files.write(`${dir}/sub/deep.txt`, 'deep')
  await waitFor('create of sub/deep.txt', async () =>
    rec.some((e) => e.name === 'sub/deep.txt' && e.type === FilesystemEventType.CREATE)
  )
  await wr.stop()
  await rejectsWith(sbx.files.watchDir(`${H}/not-there`, () => {}), FileNotFoundError, 'watching a missing dir')
})

scenario(
  A,
  '20 MiB upload',
  async () => {
    const sbx = await sandbox()
    const blob = randomBytes(20 << 20)
    const want = sha256(blob)
    const t0 = Date.now()
    const info = await sbx.files.write(`${H}/big.bin`, blob.buffer.slice(blob.byteOffset, blob.byteOffset + blob.length))
    const up = Date.now() - t0
    assert.equal(info.path, `${H}/big.bin`)
    assert.equal((await sbx.files.getInfo(`${H}/big.bin`)).size, 20 << 20)
    const r = await sbx.commands.run(`sha256sum ${H}/big.bin`, { timeoutMs: 120_000 })
    assert.equal(r.stdout.split(' ')[0], want, 'checksum inside the guest')
    const t1 = Date.now()
    const back = await sbx.files.read(`${H}/big.bin`, { format: 'bytes' })
    const down = Date.now() - t1
    assert.equal(back.length, blob.length)
    assert.equal(sha256(Buffer.from(back)), want, 'checksum of the download')
    console.log(`    (20 MiB: up ${up} ms, down ${down} ms)`)
  },
  { timeoutMs: 600_000 }
)
