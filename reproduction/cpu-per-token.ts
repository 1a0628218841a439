/**
 * CPU time a served token costs, thread by thread, for two (or more) checkouts of shoal side by
 * side. On these VMs throughput swings ±20–40 % between identical runs (docs/engine-notes.md,
 * wave 10), so a change worth a few per cent of the main thread cannot show in tok/s; the CPU each
 * thread spends per token (the scheduler's own run time, /proc/PID/task/TID/schedstat, in ns) moves
 * far less with the neighbours' load.
 *
 *   node reproduction/cpu-per-token.ts --shard DIR --checkouts '{"base":"/tmp/wt","head":"."}'
 *     [--reps 4] [--tokens 512] [--streams 8]
 *
 * An arm is a checkout's directory, or `{"dir": DIR, "env": {…}}` to start that checkout's server
 * with variables added to this process's environment.
 *
 * Per server (arms alternating A B, B A, …): an untimed round of STREAMS streams and one of a
 * single stream, then one stream of TOKENS tokens and STREAMS streams of TOKENS/4 tokens, each
 * bracketed by two reads of every thread's run time. Threads are grouped by the names Node gives
 * them: the main thread (it streams the tokens), worker threads ("WorkerThread": the engine worker
 * and onnxruntime's intra-op threads it starts, which spin inside runs, and the tokenizer's), V8's
 * helpers ("V8Worker": GC and compilers) and the rest (libuv's pool and the like). Prints µs of CPU
 * a token per group and the throughput, each arm's medians and in how many reps it spent less
 * main-thread CPU than the first arm, the command, the machine and the load.
 */
import { readdirSync, readFileSync } from 'node:fs'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { complete } from './lib/completions.ts'
import { gitDescribe, loadAverage, lscpuModel, median, promptIds } from './lib/index.ts'
import { startShoal, stop } from './lib/servers.ts'
import { loadManifest } from '../shards/index.ts'

const { values: args } = parseArgs({
  options: {
    shard: { type: 'string' },
    checkouts: { type: 'string' },
    reps: { type: 'string', default: '4' },
    tokens: { type: 'string', default: '512' },
    streams: { type: 'string', default: '8' },
    cache: { type: 'string', default: '/tmp/shoal-cpu-per-token' },
  },
})
if (args.shard === undefined || args.checkouts === undefined) throw new Error('--shard DIR and --checkouts \'{"name":"dir",…}\' are needed')
const shard = args.shard
type Arm = string | { dir: string, env?: Record<string, string> }
const arms = JSON.parse(args.checkouts) as Record<string, Arm>
const checkouts = Object.fromEntries(Object.entries(arms).map(([k, a]) => [k, typeof a === 'string' ? a : a.dir]))
const envOf = (name: string): Record<string, string> => { const a = arms[name]!; return typeof a === 'string' ? {} : a.env ?? {} }
const names = Object.keys(checkouts)
if (names.length < 2) throw new Error('--checkouts needs at least two')
const REPS = Number(args.reps)
const TOKENS = Number(args.tokens)
const STREAMS = Number(args.streams)
const manifest = await loadManifest(shard)

/** Run time so far (ns) of each thread of `pid`, by thread id, and each thread's name. */
function threadTimes (pid: number): Map<number, { name: string, ns: number }> {
  const out = new Map<number, { name: string, ns: number }>()
  for (const tid of readdirSync(`/proc/${pid}/task`)) {
    try {
      const ns = Number(readFileSync(`/proc/${pid}/task/${tid}/schedstat`, 'utf8').split(' ')[0])
      const name = readFileSync(`/proc/${pid}/task/${tid}/comm`, 'utf8').trim()
      out.set(Number(tid), { name, ns })
    } catch { /* the thread ended between the listing and the read */ }
  }
  return out
}

interface Cost { main: number, workers: number, v8: number, other: number, tokS: number }

/** CPU µs a token, by group (see the header), between two reads of the threads' run times. */
function costOf (pid: number, before: Map<number, { name: string, ns: number }>, after: Map<number, { name: string, ns: number }>, tokens: number, tokS: number): Cost {
  const ns = { main: 0, workers: 0, v8: 0, other: 0 }
  for (const [tid, t] of after) {
    const spent = t.ns - (before.get(tid)?.ns ?? 0)
    if (tid === pid) ns.main += spent
    else if (t.name === 'WorkerThread') ns.workers += spent
    else if (t.name === 'V8Worker') ns.v8 += spent
    else ns.other += spent
  }
  const us = (x: number): number => x / tokens / 1000
  return { main: us(ns.main), workers: us(ns.workers), v8: us(ns.v8), other: us(ns.other), tokS }
}

const results = new Map(names.map(n => [n, { one: [] as Cost[], many: [] as Cost[] }]))
const loadStart = loadAverage(2)
for (let rep = 0; rep < REPS; rep++) {
  for (const name of rep % 2 === 0 ? names : [...names].reverse()) {
    const bin = join(resolve(checkouts[name]!), 'scripts', 'shoal.mjs')
    const server = await startShoal(shard, manifest.modelId, `${args.cache}-${name}`, [], { bin, env: envOf(name) })
    const ep = { kind: 'shoal' as const, url: server.url, model: manifest.modelId }
    const pid = server.child.pid!
    try {
      await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await complete(ep, promptIds(128, 900 + i), 64, 0)))
      await complete(ep, promptIds(128, 999), TOKENS, 0)
      const r = results.get(name)!
      let before = threadTimes(pid)
      const one = await complete(ep, promptIds(128, rep * 100 + 9), TOKENS, 0)
      r.one.push(costOf(pid, before, threadTimes(pid), one.count, (one.count - 1) / ((one.last - one.first) / 1000)))
      before = threadTimes(pid)
      const t0 = performance.now()
      const many = await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await complete(ep, promptIds(128, rep * 100 + i), Math.ceil(TOKENS / 4), 0)))
      const count = many.reduce((a, c) => a + c.count, 0)
      r.many.push(costOf(pid, before, threadTimes(pid), count, count / ((Math.max(...many.map(c => c.end)) - t0) / 1000)))
      const f = (c: Cost): string => `main ${c.main.toFixed(0)} µs, workers ${c.workers.toFixed(0)}, V8 ${c.v8.toFixed(0)}, other ${c.other.toFixed(0)}, ${c.tokS.toFixed(0)} tok/s`
      console.log(`rep ${rep + 1} ${name}: one stream ${f(r.one.at(-1)!)}; ${STREAMS} streams ${f(r.many.at(-1)!)}`)
    } finally {
      await stop(server)
    }
  }
}

console.log('')
console.log(`- command: node reproduction/cpu-per-token.ts ${process.argv.slice(2).join(' ')}`)
console.log(`- machine: ${lscpuModel()}; Node ${process.version}`)
for (const name of names) console.log(`- ${name}: ${gitDescribe(checkouts[name]!)}${Object.keys(envOf(name)).length > 0 ? ` with ${JSON.stringify(envOf(name))}` : ''}`)
console.log(`- load average (1/5/15 min): at start ${loadStart}; at end ${loadAverage(2)}`)
console.log('')
const first = results.get(names[0]!)!
const fewer = (mine: Cost[], theirs: Cost[]): string => `${mine.filter((c, i) => c.main < theirs[i]!.main).length}/${REPS}`
console.log(`| arm | one stream: main µs/token | workers | V8 | other | tok/s | less main CPU than ${names[0]} | ${STREAMS} streams: main µs/token | workers | V8 | other | tok/s | less main CPU |`)
console.log('|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
for (const name of names) {
  const r = results.get(name)!
  const cells = (cs: Cost[]): string => (['main', 'workers', 'v8', 'other', 'tokS'] as const).map(k => median(cs.map(c => c[k])).toFixed(0)).join(' | ')
  const isFirst = name === names[0]
  console.log(`| ${name} | ${cells(r.one)} | ${isFirst ? '—' : fewer(r.one, first.one)} | ${cells(r.many)} | ${isFirst ? '—' : fewer(r.many, first.many)} |`)
}
