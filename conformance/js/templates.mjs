// templates.mjs - the JS SDK's Template builder against the server's template builds
// (e2b-templates.md section 2): fromBaseImage with copy (files uploaded through the link the
// server gives), setEnvs, runCmd as root, a start command with waitForURL; Sandbox.create by the
// name with the server already answering; a failing step as BuildError with the reason;
// Sandbox.deleteSnapshot (DELETE /templates/{id}) removing it; aptInstall of a package from the
// host's Debian mirror (the build reaches it through the egress proxy); pipInstall for the user of
// a local package and npmInstall of a package from the npm registry on the base image; fromImage
// of an image in a registry on loopback (conformance/run_local.py pushes it), open and behind a
// password; buildInBackground with getBuildStatus, tags (name:tag builds, assignTags, getTags,
// removeTags, creates by tag) and fromTemplate of a tag's version.
import assert from 'node:assert/strict'
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { BuildError, Sandbox, Template, waitForURL } from 'e2b'
import { REQUEST_TIMEOUT_MS, RUN_ID, Skip, scenario, singleAddressOnly } from './lib.mjs'

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
  'pipInstall (for the user) of a local package, npmInstall from the npm registry, on base',
  async () => {
    const name = `jspkg-${RUN_ID}`
    const ctx = mkdtempSync(join(tmpdir(), 'sp-js-pkg-'))
    let sbx
    try {
      // no PyPI here: pip installs a package from the build's own files
      mkdirSync(join(ctx, 'pkg'))
      writeFileSync(
        join(ctx, 'pkg', 'setup.py'),
        "from setuptools import setup\nsetup(name='jsdemo', version='2.0', py_modules=['jsdemo'])\n",
      )
      writeFileSync(join(ctx, 'pkg', 'jsdemo.py'), `RUN = '${RUN_ID}'\n`)
      // the run's id first: the package steps run afresh, never from an earlier run's cache
      const tpl = Template({ fileContextPath: ctx })
        .fromBaseImage()
        .runCmd(`echo ${RUN_ID} > /dev/null`)
        .copy('pkg', '/home/user/pkg')
        .pipInstall('/home/user/pkg', { g: false })
        .setWorkdir('/home/user/web')
        .npmInstall('is-odd@3.0.1')
      await Template.build(tpl, name, { ...size, ...api })
      sbx = await Sandbox.create(name, api)
      const r = await sbx.commands.run(
        "python3 -c 'import jsdemo; print(jsdemo.RUN, jsdemo.__file__.startswith(" +
          '"/home/user/.local/"))\'' +
          " && cd /home/user/web && node -e 'console.log(require(\"is-odd\")(4))'",
      )
      assert.equal(r.stdout, `${RUN_ID} True\nfalse\n`)
    } finally {
      if (sbx) await sbx.kill()
      rmSync(ctx, { recursive: true, force: true })
      await Sandbox.deleteSnapshot(name, api).catch(() => {})
    }
  },
  { timeoutMs: 900_000 },
)

scenario(
  A,
  "aptInstall: a package from the host's Debian mirror, through the egress proxy",
  async () => {
    const name = `jsapt-${RUN_ID}`
    let sbx
    try {
      // the run's id first: the package step runs afresh, never from an earlier run's cache
      const tpl = Template()
        .fromBaseImage()
        .runCmd(`echo ${RUN_ID} > /dev/null`)
        .aptInstall('hello', { noInstallRecommends: true })
      await Template.build(tpl, name, { ...size, ...api })
      sbx = await Sandbox.create(name, api)
      const r = await sbx.commands.run('hello')
      assert.equal(r.stdout, 'Hello, world!\n')
    } finally {
      if (sbx) await sbx.kill()
      await Sandbox.deleteSnapshot(name, api).catch(() => {})
    }
  },
  { timeoutMs: 900_000 },
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

scenario(
  A,
  'fromImage: an image from a registry, open and behind a password',
  async () => {
    singleAddressOnly('template builds do not depend on how sandbox traffic is addressed')
    if (process.env.CONFORMANCE_IMAGE_SKIP) throw new Skip(`no registry images: ${process.env.CONFORMANCE_IMAGE_SKIP}`)
    const ref = process.env.CONFORMANCE_IMAGE
    if (!ref) throw new Skip('no registry images (conformance/run_local.py pushes them)')
    const locked = process.env.CONFORMANCE_IMAGE_LOCKED
    const marker = process.env.CONFORMANCE_IMAGE_MARKER
    const [username, ...rest] = process.env.CONFORMANCE_IMAGE_CREDS.split(':')
    const password = rest.join(':')
    const names = [`jsimg-${RUN_ID}`, `jsimgpw-${RUN_ID}`, `jsimgbad-${RUN_ID}`]
    let sbx
    try {
      const tpl = Template().fromImage(ref).runCmd(`echo built-${RUN_ID} > /srv/built.txt`, { user: 'root' })
      await Template.build(tpl, names[0], { ...size, ...api })
      sbx = await Sandbox.create(names[0], api)
      const r = await sbx.commands.run('cat /srv/hello.txt /srv/built.txt; echo "$HELLO"; id -un')
      assert.equal(r.stdout, `${marker}\nbuilt-${RUN_ID}\nfrom image\nuser\n`)
      await sbx.kill()
      sbx = undefined
      // behind a password: the SDK's credentials pull it; a wrong password fails the build
      // with the registry's refusal, the password in no message
      await Template.build(Template().fromImage(locked, { username, password }), names[1], { ...size, ...api })
      sbx = await Sandbox.create(names[1], api)
      assert.equal((await sbx.commands.run('cat /srv/hello.txt')).stdout, `${marker}\n`)
      const wrong = Template().fromImage(locked, { username, password: `not-${password}` })
      await assert.rejects(Template.build(wrong, names[2], { ...size, ...api }), (e) => {
        assert.ok(e instanceof BuildError, `${e}`)
        assert.match(e.message, /refused the credentials/)
        assert.ok(e.message.includes(locked.split('/')[0]), e.message)
        assert.ok(!e.message.includes(password), 'the password is in the message')
        return true
      })
    } finally {
      if (sbx) await sbx.kill()
      for (const n of names) await Sandbox.deleteSnapshot(n, api).catch(() => {})
    }
  },
  { timeoutMs: 900_000 },
)

scenario(
  A,
  'buildInBackground, getBuildStatus; tags: name:tag, assign, get, remove; create, fromTemplate by tag',
  async () => {
    const name = `jstag-${RUN_ID}`
    const child = `jstagc-${RUN_ID}`
    const sbxs = []
    const cat = async (ref) => {
      const sbx = await Sandbox.create(ref, api)
      sbxs.push(sbx)
      return (await sbx.commands.run('cat /home/user/v')).stdout
    }
    try {
      // in the background: the build's id at once, its status polled until ready
      const one = Template().fromBaseImage().runCmd(`echo one-${RUN_ID} > /home/user/v`)
      const info = await Template.buildInBackground(one, `${name}:v1`, { ...size, ...api, tags: ['stable'] })
      assert.deepEqual([...info.tags].sort(), ['stable', 'v1'])
      let st
      for (let i = 0; i < 600; i++) {
        st = await Template.getBuildStatus(info, api)
        assert.equal(st.buildID, info.buildId)
        if (st.status !== 'building' && st.status !== 'waiting') break
        await new Promise((r) => setTimeout(r, 1000))
      }
      assert.equal(st.status, 'ready', JSON.stringify(st.reason))
      assert.ok(await Template.exists(`${name}:v1`, api))
      assert.ok(!(await Template.exists(`${name}:nope`, api)))
      const two = Template().fromBaseImage().runCmd(`echo two-${RUN_ID} > /home/user/v`)
      await Template.build(two, name, { ...size, ...api }) // the default tag
      assert.equal(await cat(`${name}:v1`), `one-${RUN_ID}\n`)
      assert.equal(await cat(name), `two-${RUN_ID}\n`)
      const tag = await Template.assignTags(`${name}:v1`, 'prod', api)
      assert.deepEqual(tag.tags, ['prod'])
      assert.equal(String(tag.buildId), String(info.buildId))
      assert.equal(await cat(`${name}:prod`), `one-${RUN_ID}\n`)
      const tags = new Set((await Template.getTags(name, api)).map((t) => t.tag))
      for (const t of ['v1', 'stable', 'prod', 'default']) assert.ok(tags.has(t), [...tags].join())
      await Template.removeTags(name, 'prod', api)
      await assert.rejects(Sandbox.create(`${name}:prod`, api), (e) => {
        assert.match(`${e}`, /prod/)
        return true
      })
      // a template built on a tag's version, not on the default's
      const three = Template().fromTemplate(`${name}:v1`).runCmd('echo child >> /home/user/v')
      await Template.build(three, child, { ...size, ...api })
      assert.equal(await cat(child), `one-${RUN_ID}\nchild\n`)
    } finally {
      for (const s of sbxs) await s.kill().catch(() => {})
      for (const n of [child, name]) await Sandbox.deleteSnapshot(n, api).catch(() => {})
    }
  },
  { timeoutMs: 900_000 },
)
