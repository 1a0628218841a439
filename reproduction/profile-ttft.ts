/**
 * Where a served TTFT goes: `shoal serve` started with SHOAL_TRACE_DIR (daemon/step-trace.ts), a
 * number of max_tokens-1 streamed requests from this process, one at a time, then the server
 * stopped so both its threads write their marks. Each request's marks (wall clock, so the two
 * threads and this client line up) are read in time order from the client's send to its
 * response's end, and each segment between two consecutive marks is given as its median over the
 * requests. The marks: `i.req` (the ingress's onRequest hook), `i.gen` / `i.start` (the service
 * asked, its start event back: the prefill is inside), the batcher's `b.*`, the stage engine's
 * `e.sb` / `m.post` / `m.recv`, the worker's `w.recv` / `ort.*` / `w.post`, the first token's
 * `g.pushed`, each SSE write's `i.write`, and the receipt's: `r.end` (the end event reached the
 * receipting layer), `r.built` (its input hashed), `l.batch` / `l.synced` (the ledger's synced
 * level batch), `r.appended`.
 *
 *   node reproduction/profile-ttft.ts [--size 60m] [--quant int4] [--prompt 128] [--requests 60]
 * Run it as the other benchmarks (`chrt -r 10 node …`, nothing else on the machine). The models
 * are bench-vs-llamacpp.ts's (lib/bench-models.ts).
 */
import { mkdtemp, readdir, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { ensureModels } from './lib/bench-models.ts'
import { complete } from './lib/completions.ts'
import { gitDescribe, loadAverage, lscpuModel, median, promptIds } from './lib/index.ts'
import { startShoal, stop } from './lib/servers.ts'

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: '60m' },
    quant: { type: 'string', default: 'int4' },
    prompt: { type: 'string', default: '128' },
    requests: { type: 'string', default: '60' },
  },
})
const PROMPT = Number(args.prompt)
const REQUESTS = Number(args.requests)
const log = (line: string): void => { process.stderr.write(`${line}\n`) }

const [m] = await ensureModels(args.size, args.quant, log)
if (m === undefined) throw new Error(`no model for --size ${args.size} --quant ${args.quant}`)
const traces = await mkdtemp(join(tmpdir(), 'shoal-ttft-trace-'))
const cache = await mkdtemp(join(tmpdir(), 'shoal-ttft-cache-'))
const loadStart = loadAverage(2)
const wall = (t: number): number => performance.timeOrigin + t
const requests: Array<{ sent: number, first: number, end: number }> = []
try {
  const server = await startShoal(m.shards, m.modelId, cache, [], { env: { SHOAL_TRACE_DIR: traces } })
  try {
    // Untimed: this client's own first requests, and the server's (it warms up before it listens).
    for (let i = 0; i < 10; i++) await complete(server, promptIds(PROMPT, 900 + i), 1, 0)
    for (let i = 0; i < REQUESTS; i++) {
      const c = await complete(server, promptIds(PROMPT, 1000 + i), 1, 0)
      requests.push({ sent: wall(c.t0), first: wall(c.first), end: wall(c.end) })
      // Apart, so one request's tail (the receipt's write, the worker's free) is not in the next.
      await new Promise(resolve => setTimeout(resolve, 20))
    }
  } finally {
    await stop(server) // its threads write their marks as they stop
  }
  const marks: Array<[string, number]> = []
  for (const f of await readdir(traces)) marks.push(...JSON.parse(await readFile(join(traces, f), 'utf8')) as Array<[string, number]>)
  marks.sort((a, b) => a[1] - b[1])

  const segments = new Map<string, number[]>()
  const add = (name: string, ms: number): void => {
    const seen = segments.get(name)
    if (seen === undefined) segments.set(name, [ms])
    else seen.push(ms)
  }
  for (const r of requests) {
    let prev: [string, number] = ['client sends', r.sent]
    const seen = new Set<string>()
    for (const mark of marks.filter(([, t]) => t >= r.sent && t <= r.end)) {
      const name = `${prev[0]} → ${mark[0]}`
      // A segment that recurs within a request (the second write) is its first occurrence's.
      if (!seen.has(name)) { seen.add(name); add(name, mark[1] - prev[1]) }
      prev = mark
    }
    add(`${prev[0]} → response ends`, r.end - prev[1])
  }
  console.log([
    `command: node reproduction/profile-ttft.ts ${process.argv.slice(2).join(' ')}`,
    `machine: ${lscpuModel()}; Node ${process.version}; git ${gitDescribe('.')}`,
    `load average (1/5/15 min): at start ${loadStart}; at end ${loadAverage(2)}`,
    `${m.modelId}, ${PROMPT}-token prompts, max_tokens 1, ${REQUESTS} requests: client's token chunk ${median(requests.map(r => r.first - r.sent)).toFixed(2)} ms, response's end ${median(requests.map(r => r.end - r.sent)).toFixed(2)} ms (medians)`,
  ].map(l => `- ${l}`).join('\n'))
  console.log('\n| segment | median ms | requests |\n|---|---:|---:|')
  // Segments most requests have (a mark a request lacks makes a one-off segment of its neighbours).
  for (const [name, ms] of segments) if (ms.length >= REQUESTS / 2) console.log(`| ${name} | ${median(ms).toFixed(3)} | ${ms.length} |`)
} finally {
  await rm(traces, { recursive: true, force: true })
  await rm(cache, { recursive: true, force: true })
}
