// snapshots.mjs - the JS SDK's snapshot calls (e2b-templates.md section 4): createSnapshot on a
// running sandbox (it keeps running), two sandboxes from the snapshot that each continue its
// in-memory counter and see its files, a named snapshot, listSnapshots by sandbox paged one at
// a time, deleteSnapshot true then false, and a deleted snapshot creating nothing.
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { REQUEST_TIMEOUT_MS, RUN_ID, SANDBOX_TIMEOUT_MS, forget, newSandbox, scenario, sleep } from './lib.mjs'

const A = 'snapshots'
const api = { requestTimeoutMs: REQUEST_TIMEOUT_MS }
// a counter that lives only in a shell's memory; /tmp/count shows it
const COUNTER =
  "nohup sh -c 'echo $$ > /tmp/count.pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count; " +
  "sleep 0.1; done' >/dev/null 2>&1 &"

async function count(sbx) {
  const r = await sbx.commands.run(
    // until it holds a number: `echo $i > f` truncates before it writes
    'for i in $(seq 1 100); do v=$(cat /tmp/count 2>/dev/null); [ -n "$v" ] && break; ' +
      'sleep 0.1; done; echo "$v"',
  )
  return Number(r.stdout.trim())
}

async function rising(sbx) {
  const a = await count(sbx)
  for (let i = 0; i < 40; i++) {
    await sleep(500)
    const b = await count(sbx)
    if (b > a) return [a, b]
  }
  throw new Error(`counter stuck at ${a} in ${sbx.sandboxId}`)
}

scenario(
  A,
  'createSnapshot of a running sandbox, forks, names, list, delete',
  async () => {
    const src = await newSandbox()
    const made = []
    try {
      await src.commands.run(COUNTER)
      await src.files.write('/home/user/state.txt', `js-${RUN_ID}`)
      await rising(src)
      const snap = await src.createSnapshot(api)
      assert.ok(snap.snapshotId.endsWith(':default'), snap.snapshotId)
      made.push(snap.snapshotId)
      const atSnap = await count(src)
      await src.files.write('/home/user/state.txt', 'after')
      assert.ok(await src.isRunning(), 'the source keeps running')

      const forks = []
      for (let i = 0; i < 2; i++) {
        const f = await Sandbox.create(snap.snapshotId, { ...api, timeoutMs: SANDBOX_TIMEOUT_MS })
        forks.push(f)
        assert.equal(await f.files.read('/home/user/state.txt'), `js-${RUN_ID}`)
        const [a] = await rising(f)
        assert.ok(a >= atSnap - 50, `fork counter ${a} vs ${atSnap} at the snapshot`)
      }
      assert.notEqual(forks[0].sandboxId, forks[1].sandboxId)

      const named = await Sandbox.createSnapshot(src.sandboxId, { ...api, name: `js-snap-${RUN_ID}` })
      made.push(named.snapshotId)
      assert.ok(named.names.length === 1 && named.names[0].endsWith(`js-snap-${RUN_ID}`), named)

      const seen = []
      const pager = Sandbox.listSnapshots({ ...api, sandboxId: src.sandboxId, limit: 1 })
      let pages = 0
      while (pager.hasNext && pages < 10) {
        const items = await pager.nextItems()
        pages++
        assert.ok(items.length <= 1, JSON.stringify(items))
        seen.push(...items.map((x) => x.snapshotId))
      }
      assert.deepEqual(new Set(seen), new Set([snap.snapshotId, named.snapshotId]))
      assert.ok(pages >= 2, `pages ${pages}`)

      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, api), true)
      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, api), false)
      await assert.rejects(Sandbox.create(snap.snapshotId, api), /404|not found/i)
      assert.equal(await forks[1].files.read('/home/user/state.txt'), `js-${RUN_ID}`)
      for (const f of forks) await f.kill()
    } finally {
      for (const id of made) await Sandbox.deleteSnapshot(id, api).catch(() => {})
      await src.kill().catch(() => {})
      forget(src.sandboxId)
    }
  },
  { timeoutMs: 600_000 },
)
