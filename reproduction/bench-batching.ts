/**
 * Continuous batching benchmark, side by side in one run, through the local service on generated
 * random-weight models: aggregate decode tok/s and p50/p99 inter-token latency (ITL) at 1..16
 * concurrent streams for
 *   batched — every step through the micro-batcher, a planned batch is one stepBatch (shared runs);
 *   naive   — same concurrency, each request steps the engine alone (batch-of-one runs, FIFO worker);
 *   serial  — the same requests one after another.
 * Each level runs the modes interleaved, `--rounds` times; the round with the median tok/s is kept.
 * `--max-batch` / `--delay` take lists to sweep the batcher limits (batched mode only). Mode
 * `engine` times stepBatch itself (no batcher, no service) at each streams value: wall and
 * process-CPU ms per decode run against the same sequences stepped one by one — what sets maxBatch.
 * Prints a markdown table, and writes an SVG plot with `--svg` (convert with rsvg-convert).
 * Wall-clock numbers need an otherwise idle machine; the CPU-time columns (process CPU per token,
 * all threads) stay meaningful on a shared one. `--activations int8,f32` compiles the quantized
 * model both ways and runs them side by side (int8 activations batch only equally long contexts;
 * f32 ones any); `--ragged N` varies prompt lengths by up to N tokens so contexts differ in length,
 * as real traffic does.
 *
 *   node reproduction/bench-batching.ts [--sizes 60m,250m] [--quant int4] [--activations int8] [--ragged 0] [--tokens 64] [--prompt 16]
 *     [--streams 1,2,4,8,16] [--rounds 3] [--max-batch 8,16] [--delay 2] [--threads N] [--modes batched,naive,serial,engine] [--svg out.svg]
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { createLocalService, createStageEngine, stageInfoOf } from '../daemon/engine/index.ts'
import type { LocalService } from '../daemon/engine/index.ts'
import type { GenerateRequest } from '../daemon/service.ts'
import { compileShards, generateTestModel } from '../shards/index.ts'
import type { TestModelSize } from '../shards/testmodel/generate.ts'
import { floorRank, loadAverage } from './lib/index.ts'
import { nodeKernels } from './lib/native-kernels.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    sizes: { type: 'string', default: '60m' },
    quant: { type: 'string', default: 'int4' },
    activations: { type: 'string', default: 'int8' },
    ragged: { type: 'string', default: '0' },
    tokens: { type: 'string', default: '64' },
    prompt: { type: 'string', default: '16' },
    streams: { type: 'string', default: '1,2,4,8,16' },
    rounds: { type: 'string', default: '3' },
    'max-batch': { type: 'string', default: '8,16' },
    delay: { type: 'string', default: '2' },
    threads: { type: 'string' },
    modes: { type: 'string', default: 'batched,naive,serial' },
    svg: { type: 'string' },
  },
})
const list = (s: string | undefined): number[] => (s ?? '').split(',').filter(x => x !== '').map(Number)
const TOKENS = Number(args.tokens)
const PROMPT = Number(args.prompt)
const RAGGED = Number(args.ragged)
const ACTIVATIONS = (args.activations ?? 'int8').split(',').map(a => { if (a !== 'int8' && a !== 'f32') throw new Error(`--activations: int8 or f32, not ${a}`); return a })
const STREAMS = list(args.streams)
const ROUNDS = Number(args.rounds)
const MAX_STREAMS = Math.max(...STREAMS)
const threads = args.threads === undefined ? undefined : Number(args.threads)

/** cpuMsPerToken: process CPU time (all threads) per generated token: steadier than wall time on a shared machine. */
interface Result { tokPerSec: number, itlP50: number, itlP99: number, ttftP50: number, cpuMsPerToken: number, mainCpuMsPerToken: number }

let counter = 0
const requestOf = (modelId: string, vocab: number): GenerateRequest => {
  const salt = ++counter
  return {
    requestId: `bench-${salt}`,
    model: modelId,
    prompt: { kind: 'tokens', ids: Array.from({ length: PROMPT + (RAGGED > 0 ? (salt * 7) % (RAGGED + 1) : 0) }, (_, i) => 3 + ((i * 7919 + salt * 104729) % (Math.min(vocab, 500) - 3))) },
    maxTokens: TOKENS,
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    deadline: Date.now() + 600_000,
  }
}

/** One request; every token's gap to the previous one (a delta of k tokens counts k gaps of 1/k). */
async function stream (svc: LocalService, req: GenerateRequest, itl: number[], ttft: number[]): Promise<number> {
  const t0 = performance.now()
  let last = -1
  let n = 0
  for await (const ev of svc.generate(req, new AbortController().signal)) {
    if (ev.type !== 'delta' || ev.tokenIds.length === 0) continue
    const now = performance.now()
    const k = ev.tokenIds.length
    if (last < 0) { ttft.push(now - t0); for (let i = 1; i < k; i++) itl.push(0) } else for (let i = 0; i < k; i++) itl.push((now - last) / k)
    last = now
    n += k
  }
  return n
}

async function measure (svc: LocalService, modelId: string, vocab: number, streams: number, serial: boolean): Promise<Result> {
  const itl: number[] = []
  const ttft: number[] = []
  const t0 = performance.now()
  const c0 = process.cpuUsage()
  const m0 = process.threadCpuUsage()
  let total = 0
  if (serial) {
    for (let i = 0; i < streams; i++) total += await stream(svc, requestOf(modelId, vocab), itl, ttft)
  } else {
    const counts = await Promise.all(Array.from({ length: streams }, async () => await stream(svc, requestOf(modelId, vocab), itl, ttft)))
    total = counts.reduce((a, b) => a + b, 0)
  }
  const wall = (performance.now() - t0) / 1000
  const cpu = process.cpuUsage(c0)
  const main = process.threadCpuUsage(m0)
  return { mainCpuMsPerToken: (main.user + main.system) / 1000 / total, tokPerSec: total / wall, itlP50: floorRank(itl, 0.5), itlP99: floorRank(itl, 0.99), ttftP50: floorRank(ttft, 0.5), cpuMsPerToken: (cpu.user + cpu.system) / 1000 / total }
}

interface Row { size: string, mode: string, streams: number, result: Result }
const rows: Row[] = []
const fmt = (r: Result): string => `${r.tokPerSec.toFixed(0).padStart(6)} tok/s  ITL p50 ${r.itlP50.toFixed(1).padStart(6)} ms  p99 ${r.itlP99.toFixed(1).padStart(6)} ms  TTFT p50 ${r.ttftP50.toFixed(0).padStart(5)} ms  cpu ${r.cpuMsPerToken.toFixed(2)} ms/tok (main thread ${r.mainCpuMsPerToken.toFixed(2)})`

for (const size of (args.sizes ?? '60m').split(',')) {
  const dir = await mkdtemp(join(tmpdir(), 'shoal-bench-batching-'))
  try {
    const t0 = performance.now()
    await generateTestModel({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: size as TestModelSize })
    const quant = args.quant as 'none' | 'int8' | 'int4'
    // One shard directory per activation format (int8: accuracy level 4, as recorded so far).
    const shardOf = (act: string): string => join(dir, `shard-${act}`)
    const manifests = new Map<string, Awaited<ReturnType<typeof compileShards>>>()
    for (const act of ACTIVATIONS) {
      manifests.set(act, await compileShards({ modelDir: join(dir, 'ckpt'), outDir: shardOf(act), modelId: `bench-${size}`, quant, accuracyLevel: act === 'int8' ? 4 : 0 }))
    }
    const manifest = manifests.get(ACTIVATIONS[0]!)
    if (manifest === undefined) throw new Error('no --activations given')
    await rm(join(dir, 'ckpt'), { recursive: true, force: true })
    console.log(`\n## ${size} ${quant}${quant !== 'none' ? ` (${ACTIVATIONS.join(', ')} activations)` : ''} (built in ${((performance.now() - t0) / 1000).toFixed(0)} s), ${PROMPT}${RAGGED > 0 ? `–${PROMPT + RAGGED}` : ''}-token prompts, ${TOKENS} tokens each, threads ${threads ?? 'all'}, load average ${loadAverage()}, malloc: ${mallocSettings()}`)
    const vocab = manifest.shape.vocabSize
    if ((args.modes ?? '').split(',').includes('engine')) await engineSteps(join(shardOf(ACTIVATIONS[0]!), ...manifest.stages[0]!.graph.split('/')), stageInfoOf(manifest), await nodeKernels(manifest))
    const services = new Map<string, LocalService>()
    const modes = (args.modes ?? '').split(',')
    for (const act of ACTIVATIONS) {
      // On shoal's kernels where `shoal serve` runs them.
      const base = { shardDir: shardOf(act), maxSequences: MAX_STREAMS, ...(threads === undefined ? {} : { threads }), ...await nodeKernels(manifests.get(act)!) }
      // Named by format only when there is more than one, so single-format runs read as before.
      const tag = ACTIVATIONS.length > 1 && quant !== 'none' ? ` ${act}` : ''
      for (const mb of list(args['max-batch'])) {
        for (const delay of list(args.delay)) {
          if (!modes.includes('batched')) continue
          services.set(`batched b${mb} d${delay}${tag}`, createLocalService({ ...base, batchLimits: { maxBatch: mb, maxQueueDelayMs: delay } }))
        }
      }
      if (modes.includes('naive') || modes.includes('serial')) services.set(`naive${tag}`, createLocalService({ ...base, batching: false }))
    }
    for (const svc of services.values()) { await svc.start(); await measure(svc, manifest.modelId, vocab, 2, false) } // warm-up
    for (const streams of STREAMS) {
      const plan: Array<[string, LocalService, boolean]> = []
      for (const [name, svc] of services) {
        const naive = name.startsWith('naive')
        if (!naive || modes.includes('naive')) plan.push([name, svc, false])
        if (naive && modes.includes('serial')) plan.push([name.replace('naive', 'serial'), svc, true])
      }
      const per = new Map<string, Result[]>()
      for (let r = 0; r < ROUNDS; r++) {
        for (const [name, svc, serial] of plan) {
          if (serial && streams > 4 && r > 0) continue // serial is one stream's numbers, repeated: one round will do
          const res = await measure(svc, manifest.modelId, vocab, serial ? Math.min(streams, 4) : streams, serial)
          per.set(name, [...(per.get(name) ?? []), res])
        }
      }
      for (const [name] of plan) {
        const rs = [...per.get(name)!].sort((a, b) => a.tokPerSec - b.tokPerSec)
        const result = rs[Math.floor(rs.length / 2)]!
        rows.push({ size, mode: name, streams, result })
        console.log(`${String(streams).padStart(3)} streams  ${name.padEnd(18)} ${fmt(result)}`)
      }
    }
    for (const svc of services.values()) await svc.stop()
  } finally {
    await rm(dir, { recursive: true, force: true })
  }
}

console.log('\n| model | mode | streams | tok/s | × 1 stream (same mode) | ITL p50 ms | ITL p99 ms | p99 / 1-stream p99 | TTFT p50 ms | CPU ms/token | CPU-time speed-up |')
console.log('|---|---|---|---|---|---|---|---|---|---|---|')
for (const r of rows) {
  const one = rows.find(x => x.size === r.size && x.mode === r.mode && x.streams === 1)?.result
  const ratio = one === undefined ? '' : (r.result.tokPerSec / one.tokPerSec).toFixed(2)
  const p99 = one === undefined ? '' : (r.result.itlP99 / one.itlP99).toFixed(2)
  const cpuGain = one === undefined ? '' : (one.cpuMsPerToken / r.result.cpuMsPerToken).toFixed(2)
  console.log(`| ${r.size} | ${r.mode} | ${r.streams} | ${r.result.tokPerSec.toFixed(0)} | ${ratio} | ${r.result.itlP50.toFixed(1)} | ${r.result.itlP99.toFixed(1)} | ${p99} | ${r.result.ttftP50.toFixed(0)} | ${r.result.cpuMsPerToken.toFixed(2)} | ${cpuGain} |`)
}
if (args.svg !== undefined) {
  await writeFile(args.svg, plotSvg(rows.map(r => ({ series: `${r.size} ${r.mode}`, x: r.streams, tokPerSec: r.result.tokPerSec, tokPerCpuSec: 1000 / r.result.cpuMsPerToken, itlP99: r.result.itlP99 }))))
  console.log(`\nplot: ${args.svg}`)
}

/** stepBatch of B decodes vs B single steps, same sequences (48-token context), median of 30. */
async function engineSteps (graphPath: string, stage: ReturnType<typeof stageInfoOf>, kernels: { kernels?: string }): Promise<void> {
  const engine = createStageEngine({ graphPath, stage, maxSequences: MAX_STREAMS, ...(threads === undefined ? {} : { threads }), ...kernels })
  await engine.start()
  const med = (xs: number[]): number => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!
  const cpuMs = (c: NodeJS.CpuUsage): number => (c.user + c.system) / 1000
  let one = 0
  for (const B of STREAMS) {
    const seqs = await Promise.all(Array.from({ length: B }, async (_, i) => await engine.open(`e${B}-${i}`)))
    await engine.stepBatch(seqs.map((seqId, i) => ({ seqId, input: { tokenIds: Array.from({ length: 48 }, (_, j) => 5 + ((i + j * 13) % 400)) }, positions: Array.from({ length: 48 }, (_, j) => j) })))
    const wall: number[] = []
    const cpu: number[] = []
    const wallSingle: number[] = []
    const cpuSingle: number[] = []
    for (let t = 0; t < 30; t++) {
      let c0 = process.cpuUsage()
      let t0 = performance.now()
      await engine.stepBatch(seqs.map(seqId => ({ seqId, input: { tokenIds: [7] }, positions: [48 + 2 * t] })))
      wall.push(performance.now() - t0)
      cpu.push(cpuMs(process.cpuUsage(c0)))
      c0 = process.cpuUsage()
      t0 = performance.now()
      for (const seqId of seqs) await engine.step(seqId, { tokenIds: [7] }, [49 + 2 * t])
      wallSingle.push(performance.now() - t0)
      cpuSingle.push(cpuMs(process.cpuUsage(c0)))
    }
    if (B === 1) one = med(cpu)
    console.log(`engine B=${String(B).padStart(2)}: stepBatch ${med(wall).toFixed(2)} ms wall, ${med(cpu).toFixed(2)} ms CPU (${(med(cpu) / one).toFixed(2)}× B=1; ${(med(cpu) / B).toFixed(2)} ms CPU/token) | ${B} single steps ${med(wallSingle).toFixed(2)} ms wall, ${med(cpuSingle).toFixed(2)} ms CPU`)
    for (const seqId of seqs) await engine.free(seqId)
  }
  await engine.stop()
}

/** Three panels (tok/s, tokens per CPU-second, p99 ITL against streams, log2 x), one line per series; plain SVG. */
function plotSvg (points: Array<{ series: string, x: number, tokPerSec: number, tokPerCpuSec: number, itlP99: number }>): string {
  const series = [...new Set(points.map(p => p.series))]
  const colors = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f']
  const xs = [...new Set(points.map(p => p.x))].sort((a, b) => a - b)
  const W = 360
  const H = 300
  const m = { l: 60, r: 15, t: 30, b: 45 }
  const out: string[] = [`<svg xmlns="http://www.w3.org/2000/svg" width="${3 * W}" height="${H + 22 * Math.ceil(series.length / 3)}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>`]
  const panel = (ox: number, title: string, get: (p: typeof points[number]) => number): void => {
    const max = Math.max(...points.map(get)) * 1.1
    const lx = (x: number): number => ox + m.l + (Math.log2(x) - Math.log2(xs[0]!)) / Math.max(1e-9, Math.log2(xs.at(-1)!) - Math.log2(xs[0]!)) * (W - m.l - m.r)
    const ly = (y: number): number => H - m.b - y / max * (H - m.t - m.b)
    out.push(`<text x="${ox + W / 2}" y="18" text-anchor="middle" font-weight="bold">${title}</text>`)
    out.push(`<line x1="${ox + m.l}" y1="${H - m.b}" x2="${ox + W - m.r}" y2="${H - m.b}" stroke="black"/><line x1="${ox + m.l}" y1="${m.t}" x2="${ox + m.l}" y2="${H - m.b}" stroke="black"/>`)
    for (const x of xs) out.push(`<text x="${lx(x)}" y="${H - m.b + 16}" text-anchor="middle">${x}</text>`)
    out.push(`<text x="${ox + W / 2}" y="${H - 8}" text-anchor="middle">concurrent streams</text>`)
    for (let i = 0; i <= 4; i++) {
      const y = max / 1.1 * i / 4
      out.push(`<text x="${ox + m.l - 5}" y="${ly(y) + 4}" text-anchor="end">${y >= 100 ? y.toFixed(0) : y.toFixed(1)}</text><line x1="${ox + m.l}" y1="${ly(y)}" x2="${ox + W - m.r}" y2="${ly(y)}" stroke="#ddd"/>`)
    }
    series.forEach((s, i) => {
      const pts = points.filter(p => p.series === s).sort((a, b) => a.x - b.x).map(p => `${lx(p.x).toFixed(1)},${ly(get(p)).toFixed(1)}`)
      out.push(`<polyline fill="none" stroke="${colors[i % colors.length]}" stroke-width="2" points="${pts.join(' ')}"/>`)
    })
  }
  panel(0, 'aggregate tok/s (wall clock)', p => p.tokPerSec)
  panel(W, 'tokens per CPU-second (all threads)', p => p.tokPerCpuSec)
  panel(2 * W, 'p99 inter-token latency (ms)', p => p.itlP99)
  series.forEach((s, i) => {
    const x = 20 + (i % 3) * 340
    const y = H + 10 + 22 * Math.floor(i / 3)
    out.push(`<rect x="${x}" y="${y}" width="14" height="4" fill="${colors[i % colors.length]}"/><text x="${x + 20}" y="${y + 6}">${s}</text>`)
  })
  out.push('</svg>')
  return out.join('\n')
}
