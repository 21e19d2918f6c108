// run.mjs - runs the conformance scenarios and prints what passed.
//
//   node run.mjs [FILTER...]
//
// FILTER: substrings matched against "area/scenario" (any may match); CONFORMANCE_FILTER
// does the same from the environment. Exit status: 0 all selected scenarios passed,
// 1 some failed, 2 bad configuration.
import { writeFileSync } from 'node:fs'
import { sandboxTarget, withDeadline } from '../common.mjs'
import { cleanup, configProblem, registered, RUN_ID, Skip, TEMPLATE } from './lib.mjs'
import './lifecycle.mjs'
import './commands.mjs'
import './files.mjs'
import './templates.mjs'
import './snapshots.mjs'
import { cleanupCodeInterpreter } from './code_interpreter.mjs'

const problem = configProblem()
if (problem) {
  console.error(`conformance: ${problem}`)
  process.exit(2)
}

const filters = process.argv.slice(2)
if (process.env.CONFORMANCE_FILTER) filters.push(...process.env.CONFORMANCE_FILTER.split(','))
const selected = registered().filter(
  (s) => filters.length === 0 || filters.some((f) => `${s.area}/${s.name}`.includes(f))
)

// Each scenario races a deadline (withDeadline); late rejections of abandoned work are noted,
// not failures (../common.mjs).
console.log(
  `e2b JS SDK conformance: API ${process.env.E2B_API_URL || '(from domain)'}, ${sandboxTarget()}, ` +
    `template ${TEMPLATE}, run ${RUN_ID}`
)

const results = []
for (const s of selected) {
  const t0 = Date.now()
  let error = null
  try {
    await withDeadline(Promise.resolve().then(s.fn), s.timeoutMs)
  } catch (e) {
    error = e
  }
  const ms = Date.now() - t0
  const skipped = error instanceof Skip
  if (skipped) {
    results.push({ area: s.area, name: s.name, ok: true, skipped, ms, error: null })
    console.log(`  SKIP ${s.area}/${s.name} (${ms} ms): ${error.message}`)
    continue
  }
  results.push({ area: s.area, name: s.name, ok: !error, ms, error })
  const mark = error ? 'FAIL' : 'PASS'
  console.log(`  ${mark} ${s.area}/${s.name} (${ms} ms)` + (error ? `: ${oneLine(error)}` : ''))
  if (error && process.env.CONFORMANCE_VERBOSE) console.error(error)
}

const leftovers = [...(await cleanup()), ...(await cleanupCodeInterpreter())]

function oneLine(e) {
  const name = e?.constructor?.name && e.constructor.name !== 'Error' ? `${e.constructor.name}: ` : ''
  return (name + (e?.message ?? String(e))).replace(/\s+/g, ' ').slice(0, 300)
}

function table(rows) {
  const head = ['area', 'scenario', 'result', 'ms']
  const data = rows.map((r) => [
    r.area,
    r.name,
    r.skipped ? 'SKIP' : r.ok ? 'PASS' : 'FAIL',
    String(r.ms),
  ])
  const w = head.map((h, i) => Math.max(h.length, ...data.map((d) => d[i].length)))
  const line = (cells) => cells.map((c, i) => (i === 3 ? c.padStart(w[i]) : c.padEnd(w[i]))).join(' | ')
  return [line(head), w.map((n) => '-'.repeat(n)).join('-|-'), ...data.map(line)].join('\n')
}

const failed = results.filter((r) => !r.ok)
const skipped = results.filter((r) => r.skipped)
console.log('\n' + table(results))
console.log(
  `\n${results.length - failed.length - skipped.length}/${results.length} passed, ` +
    `${skipped.length} skipped here`
)
if (failed.length) {
  console.log('\nfailures:')
  for (const r of failed) console.log(`  ${r.area}/${r.name}: ${oneLine(r.error)}`)
}
if (leftovers.length) console.log(`\ncleanup could not kill: ${leftovers.join('; ')}`)
if (process.env.CONFORMANCE_JSON) {
  writeFileSync(
    process.env.CONFORMANCE_JSON,
    JSON.stringify(
      results.map((r) => ({
        area: r.area,
        scenario: r.name,
        ok: r.ok,
        skipped: Boolean(r.skipped),
        ms: r.ms,
        error: r.ok ? null : oneLine(r.error),
      })),
      null,
      2
    )
  )
}
process.exit(failed.length || selected.length === 0 ? 1 : 0)
