// templates.mjs - the JS SDK's Template builder against the server's template builds
// (e2b-templates.md section 2): fromBaseImage with copy (files uploaded through the link the
// server gives), setEnvs, runCmd as root, a start command with waitForURL; Sandbox.create by
// the name with the server already answering; a failing step as BuildError with the reason;
// Sandbox.deleteSnapshot (DELETE /templates/{id}) removing it.
import assert from 'node:assert/strict'
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { BuildError, Sandbox, Template, waitForURL } from 'e2b'
import { REQUEST_TIMEOUT_MS, RUN_ID, scenario } from './lib.mjs'

const A = 'templates'
const api = { requestTimeoutMs: REQUEST_TIMEOUT_MS }
const size = { cpuCount: 1, memoryMB: 256 } // base's size: its spare clones serve the builder

scenario(
  A,
  'Template builder: copy, env, runCmd, start and ready commands',
  async () => {
    const name = `js-${RUN_ID}`
    const ctx = mkdtempSync(join(tmpdir(), 'sp-js-tpl-'))
    let sbx
    try {
      mkdirSync(join(ctx, 'site'))
      writeFileSync(join(ctx, 'site', 'index.html'), `js-${RUN_ID}\n`)
      const tpl = Template({ fileContextPath: ctx })
        .fromBaseImage()
        .setEnvs({ GREETING: `hi ${RUN_ID}` })
        .copy('site', '/home/user/site')
        .runCmd('echo "$GREETING" > /greeting.txt', { user: 'root' })
        .setStartCmd(
          'cd /home/user/site && python3 -m http.server 8000',
          waitForURL('http://127.0.0.1:8000/index.html'),
        )
      const logs = []
      const info = await Template.build(tpl, name, { ...size, ...api, onBuildLogs: (e) => logs.push(e) })
      assert.equal(info.templateId, name)
      assert.ok(logs.length > 0, 'the build log reaches onBuildLogs')
      sbx = await Sandbox.create(name, api)
      const r = await sbx.commands.run('curl -sf http://127.0.0.1:8000/index.html; cat /greeting.txt')
      assert.equal(r.stdout, `js-${RUN_ID}\nhi ${RUN_ID}\n`)
    } finally {
      if (sbx) await sbx.kill()
      rmSync(ctx, { recursive: true, force: true })
    }
    assert.equal(await Sandbox.deleteSnapshot(name, api), true)
    assert.equal(await Sandbox.deleteSnapshot(name, api), false)
  },
  { timeoutMs: 600_000 },
)

scenario(
  A,
  'a failing step rejects with BuildError and the reason',
  async () => {
    const name = `jsfail-${RUN_ID}`
    try {
      const tpl = Template().fromBaseImage().runCmd('echo js-about-to-fail; exit 5')
      await assert.rejects(Template.build(tpl, name, { ...size, ...api }), (e) => {
        assert.ok(e instanceof BuildError, `${e}`)
        assert.match(e.message, /exited with code 5/)
        assert.match(e.message, /js-about-to-fail/)
        return true
      })
    } finally {
      await Sandbox.deleteSnapshot(name, api).catch(() => {}) // a failure above is the news
    }
  },
  { timeoutMs: 600_000 },
)
