/**
 * What serving through the daemon costs over the bare engine, on one machine: generated 60m and
 * 250m Llama checkpoints (random weights, real shapes), fp32 and int4, each measured side by side
 * in one process —
 *  - decode tok/s of one greedy stream through HTTP (the daemon `shoal serve` runs + the openai
 *    client, streaming) vs a plain greedy loop over the same shard's stage engine (createStageEngine,
 *    one worker thread in both cases), reps alternating between the two;
 *  - time to first token (short prompt) and prefill tok/s of a 512-token prompt, both ways;
 *  - peak RSS of the serving process (daemon + client) against the weight bytes;
 *  - /healthz latency (p50/p99/max) while a 2,000-token prefill runs, and idle for comparison.
 * Each model runs in its own child process so peak RSS is its own. No assertions: a benchmark.
 *
 * Run: node reproduction/bench-engine.ts [--sizes 60m,250m] [--quants none,int4] [--tokens 128]
 *        [--reps 6] [--prompt 512] [--health 2000] [--skip 250m-none]
 * Models are generated and compiled once into .cache/bench/ and reused.
 */
import { spawn } from 'node:child_process'
import { existsSync } from 'node:fs'
import { mkdir, mkdtemp, rename, rm } from 'node:fs/promises'
import { availableParallelism, cpus, tmpdir, totalmem } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import OpenAI from 'openai'
import { chooseStageGraphs, createStageEngine, GREEDY_PICK, resolveGraphChoice, stageInfoOf } from '../daemon/engine/index.ts'
import type { StageEngine } from '../daemon/engine/index.ts'
import { compileShards, generateTestModel, loadManifest } from '../shards/index.ts'
import type { TestModelSize } from '../shards/index.ts'
import { benchDaemon, loadAverage, lowerMedian, nearestRank, promptIds, tokenOf } from './lib/index.ts'
import { nodeKernels } from './lib/native-kernels.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    sizes: { type: 'string', default: '60m,250m' },
    quants: { type: 'string', default: 'none,int4' },
    tokens: { type: 'string', default: '128' },
    reps: { type: 'string', default: '6' },
    prompt: { type: 'string', default: '512' },
    health: { type: 'string', default: '2000' },
    skip: { type: 'string', default: '' },
    child: { type: 'string' },
  },
})
const TOKENS = Number(args.tokens)
const REPS = Number(args.reps)
const PREFILL = Number(args.prompt)
const HEALTH_PREFILL = Number(args.health)
const SHORT_PROMPT = 16
const BENCH_DIR = resolve(import.meta.dirname, '..', '.cache', 'bench')

interface RunResult { ttftMs: number, decodeTokS: number, ids: number[] }
interface HealthStats { n: number, p50: number, p99: number, max: number }
interface ChildResult {
  model: string
  quant: string
  weightBytes: number
  loadMs: number
  baselineRss: number
  peakRss: number
  raw: { decode: number[], ttft: number[], prefillMs: number[] }
  http: { decode: number[], ttft: number[], prefillMs: number[] }
  sameTokens: boolean
  healthIdle: HealthStats
  healthPrefill: HealthStats & { prefillMs: number }
}

// ---------------------------------------------------------------- child: one model

/** Greedy, picked in the engine worker as the daemon does: only the token id comes back. */
const GREEDY = { pick: GREEDY_PICK }

/** The bare engine: open, prefill, greedy decode (picked in the worker), free — what the daemon does minus HTTP, text and receipts. */
async function rawRun (engine: StageEngine, prompt: number[], maxTokens: number): Promise<RunResult> {
  const t0 = performance.now()
  const seq = await engine.open()
  try {
    let token = tokenOf(await engine.step(seq, { tokenIds: prompt }, prompt.map((_, i) => i), GREEDY))
    const first = performance.now()
    const ids = [token]
    for (let i = 1; i < maxTokens; i++) {
      token = tokenOf(await engine.step(seq, { tokenIds: [token] }, [prompt.length + i - 1], GREEDY))
      ids.push(token)
    }
    const last = performance.now()
    return { ttftMs: first - t0, decodeTokS: (ids.length - 1) / ((last - first) / 1000), ids }
  } finally {
    await engine.free(seq)
  }
}

/** One streamed greedy completion through the daemon; times are taken where the client sees tokens. */
async function httpRun (client: OpenAI, model: string, prompt: number[], maxTokens: number): Promise<RunResult> {
  const t0 = performance.now()
  const stream = await client.completions.create({ model, prompt, max_tokens: maxTokens, temperature: 0, stream: true, return_token_ids: true } as OpenAI.CompletionCreateParamsStreaming)
  let first: number | undefined
  let last = 0
  let firstCount = 0
  const ids: number[] = []
  for await (const chunk of stream) {
    const got = (chunk.choices[0] as { token_ids?: number[] } | undefined)?.token_ids ?? []
    if (got.length === 0) continue
    last = performance.now()
    if (first === undefined) { first = last; firstCount = got.length }
    ids.push(...got)
  }
  if (first === undefined) throw new Error('no tokens came back')
  return { ttftMs: first - t0, decodeTokS: (ids.length - firstCount) / ((last - first) / 1000), ids }
}

async function pollHealth (url: string, until: () => boolean, gapMs: number, max = Infinity): Promise<number[]> {
  const lat: number[] = []
  while (!until() && lat.length < max) {
    const t = performance.now()
    const res = await fetch(`${url}/healthz`)
    await res.arrayBuffer()
    lat.push(performance.now() - t)
    if (gapMs > 0) await sleep(gapMs)
  }
  return lat
}
const stats = (lat: number[]): HealthStats => ({ n: lat.length, p50: nearestRank(lat, 0.5), p99: nearestRank(lat, 0.99), max: Math.max(...lat) })

async function runChild (shardDir: string): Promise<ChildResult> {
  const manifest = await loadManifest(shardDir)
  const stage = manifest.stages[0]!
  const weightBytes = stage.files.reduce((a, f) => a + f.bytes, 0)
  const root = await mkdtemp(join(tmpdir(), 'shoal-bench-engine-'))
  const baselineRss = process.memoryUsage().rss
  const result: Omit<ChildResult, 'peakRss' | 'sameTokens' | 'healthIdle' | 'healthPrefill'> = {
    model: manifest.modelId,
    quant: manifest.quantization.kind,
    weightBytes,
    loadMs: 0,
    baselineRss,
    raw: { decode: [], ttft: [], prefillMs: [] },
    http: { decode: [], ttft: [], prefillMs: [] },
  }
  const t0 = performance.now()
  const daemon = benchDaemon(shardDir, root)
  let engine: StageEngine | undefined
  try {
    const { apiUrl } = await daemon.start()
    result.loadMs = performance.now() - t0
    const url = apiUrl!
    const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'bench', maxRetries: 0, timeout: 600_000 })
    const model = manifest.modelId
    await httpRun(client, model, promptIds(SHORT_PROMPT), 8) // warm-up

    // One prefill sizes the health poll; then /healthz idle and under a long prefill.
    const firstPrefillMs = (await httpRun(client, model, promptIds(PREFILL), 1)).ttftMs
    const healthIdle = stats(await pollHealth(url, () => false, 5, 100))
    const estimateMs = firstPrefillMs * (HEALTH_PREFILL / PREFILL) * 1.3
    let done = false
    const tp = performance.now()
    const long = client.completions.create({ model, prompt: promptIds(HEALTH_PREFILL, 9), max_tokens: 1, temperature: 0 }).finally(() => { done = true })
    const lat = await pollHealth(url, () => done, Math.max(0, estimateMs / 100 - 1))
    await long
    const healthPrefill = { ...stats(lat), prefillMs: performance.now() - tp }
    const peakRss = process.resourceUsage().maxRSS * 1024

    // The bare engine on the same graph, alongside (idle ORT sessions do not spin), reps alternating.
    // On shoal's kernels where `shoal serve` runs them.
    engine = createStageEngine({ ...resolveGraphChoice(shardDir, chooseStageGraphs(manifest, 0, 'CPU')), stage: stageInfoOf(manifest), backend: 'onnxruntime', device: 'CPU', ...await nodeKernels(manifest) })
    await engine.start()
    await rawRun(engine, promptIds(SHORT_PROMPT), 8) // warm-up
    let sameTokens = true
    for (let r = 0; r < REPS; r++) {
      const order = r % 2 === 0 ? ['raw', 'http'] : ['http', 'raw']
      let rawIds: number[] = []
      let httpIds: number[] = []
      for (const which of order) {
        const prompt = promptIds(SHORT_PROMPT, r)
        if (which === 'raw') {
          const x = await rawRun(engine, prompt, TOKENS)
          result.raw.decode.push(x.decodeTokS); rawIds = x.ids
          result.raw.ttft.push((await rawRun(engine, prompt, 1)).ttftMs)
          result.raw.prefillMs.push((await rawRun(engine, promptIds(PREFILL, r + 1), 1)).ttftMs)
        } else {
          const x = await httpRun(client, model, prompt, TOKENS)
          result.http.decode.push(x.decodeTokS); httpIds = x.ids
          // max_tokens 1: a streamed token whose text is half a UTF-8 character waits for the next
          // one, so the first chunk of a longer stream can trail the first token by a decode step.
          result.http.ttft.push((await httpRun(client, model, prompt, 1)).ttftMs)
          result.http.prefillMs.push((await httpRun(client, model, promptIds(PREFILL, r + 1), 1)).ttftMs)
        }
      }
      // The daemon stops at EOS; the bare loop does not: compare the common prefix.
      if (httpIds.some((id, i) => id !== rawIds[i])) sameTokens = false
    }
    return { ...result, peakRss, sameTokens, healthIdle, healthPrefill }
  } finally {
    await engine?.stop()
    await daemon.stop()
    await rm(root, { recursive: true, force: true })
  }
}

// ---------------------------------------------------------------- parent: models, children, table

async function ensureModels (size: TestModelSize, quants: string[]): Promise<Map<string, string>> {
  const ckpt = join(BENCH_DIR, `llama-${size}`)
  await mkdir(BENCH_DIR, { recursive: true })
  if (!existsSync(join(ckpt, 'config.json'))) {
    const t = performance.now()
    const tmp = `${ckpt}.tmp-${process.pid}`
    await generateTestModel({ architecture: 'llama', size, outDir: tmp, seed: 1, modelId: `llama-${size}` })
    await rename(tmp, ckpt)
    console.error(`generated ${ckpt} in ${((performance.now() - t) / 1000).toFixed(1)} s`)
  }
  const out = new Map<string, string>()
  for (const quant of quants) {
    const dir = join(BENCH_DIR, `llama-${size}-${quant}`)
    if (!existsSync(join(dir, 'manifest.json'))) {
      const t = performance.now()
      const tmp = `${dir}.tmp-${process.pid}`
      await compileShards({ modelDir: ckpt, outDir: tmp, quant: quant as 'none' | 'int4', modelId: `llama-${size}-${quant === 'none' ? 'fp32' : quant}` })
      await rename(tmp, dir)
      console.error(`compiled ${dir} in ${((performance.now() - t) / 1000).toFixed(1)} s`)
    }
    out.set(quant, dir)
  }
  return out
}

async function spawnChild (shardDir: string): Promise<ChildResult> {
  const child = spawn(process.execPath, [import.meta.filename, '--child', shardDir, '--tokens', String(TOKENS), '--reps', String(REPS), '--prompt', String(PREFILL), '--health', String(HEALTH_PREFILL)], { stdio: ['ignore', 'pipe', 'inherit'] })
  let stdout = ''
  child.stdout.setEncoding('utf8').on('data', (s: string) => { stdout += s })
  const code = await new Promise<number | null>(resolve => child.once('exit', resolve))
  if (code !== 0) throw new Error(`child for ${shardDir} exited ${code}`)
  return JSON.parse(stdout.trim().split('\n').at(-1)!) as ChildResult
}

const f0 = (x: number): string => x.toFixed(0)
const f1 = (x: number): string => x.toFixed(1)
const f2 = (x: number): string => x.toFixed(2)
const mb = (b: number): string => (b / 2 ** 20).toFixed(0)

function table (rows: ChildResult[]): string {
  const lines: string[] = []
  // Background load only ever slows a rep down: the best rep of each side is the steadiest
  // estimate of its speed, and the median of adjacent-pair ratios the steadiest of the ratio.
  lines.push(`| model | weights MB | decode tok/s raw (best / median) | decode tok/s HTTP (best / median) | HTTP/raw best | HTTP/raw per rep (median) | HTTP ms/token over raw (best) | TTFT ms raw / HTTP (${SHORT_PROMPT}-tok prompt, median) | prefill tok/s raw / HTTP (${PREFILL} tok, best) | HTTP/raw | tokens equal |`)
  lines.push('|---|---|---|---|---|---|---|---|---|---|---|')
  for (const r of rows) {
    const dr = Math.max(...r.raw.decode)
    const dh = Math.max(...r.http.decode)
    const pairs = r.http.decode.map((h, i) => h / r.raw.decode[i]!)
    const pr = PREFILL / (Math.min(...r.raw.prefillMs) / 1000)
    const ph = PREFILL / (Math.min(...r.http.prefillMs) / 1000)
    lines.push(`| ${r.model} | ${mb(r.weightBytes)} | ${f1(dr)} / ${f1(lowerMedian(r.raw.decode))} | ${f1(dh)} / ${f1(lowerMedian(r.http.decode))} | **${f2(dh / dr)}** | ${f2(lowerMedian(pairs))} (${pairs.map(f2).join(' ')}) | ${f2(1000 / dh - 1000 / dr)} | ${f1(lowerMedian(r.raw.ttft))} / ${f1(lowerMedian(r.http.ttft))} | ${f0(pr)} / ${f0(ph)} | ${f2(ph / pr)} | ${r.sameTokens ? 'yes' : 'NO'} |`)
  }
  lines.push('')
  lines.push(`| model | load s | peak RSS MB | RSS − baseline MB | (RSS − baseline) / weights | /healthz idle p50 / p99 / max ms | /healthz during ${HEALTH_PREFILL}-tok prefill p50 / p99 / max ms (polls) | that prefill s |`)
  lines.push('|---|---|---|---|---|---|---|---|')
  for (const r of rows) {
    const h = r.healthPrefill
    lines.push(`| ${r.model} | ${f1(r.loadMs / 1000)} | ${mb(r.peakRss)} | ${mb(r.peakRss - r.baselineRss)} | ${f2((r.peakRss - r.baselineRss) / r.weightBytes)} | ${f2(r.healthIdle.p50)} / ${f2(r.healthIdle.p99)} / ${f2(r.healthIdle.max)} | ${f2(h.p50)} / ${f2(h.p99)} / ${f2(h.max)} (${h.n}) | ${f1(h.prefillMs / 1000)} |`)
  }
  const bySize = new Map<string, Map<string, ChildResult>>()
  for (const r of rows) {
    const size = r.model.split('-')[1]!
    bySize.set(size, (bySize.get(size) ?? new Map<string, ChildResult>()).set(r.quant, r))
  }
  const pairs = [...bySize].filter(([, m]) => m.has('none') && m.has('int4'))
  if (pairs.length > 0) {
    lines.push('')
    lines.push('| size | int4 / fp32 decode (HTTP, best) | int4 / fp32 prefill (HTTP, best) | int4 / fp32 weights | int4 / fp32 peak RSS |')
    lines.push('|---|---|---|---|---|')
    for (const [size, m] of pairs) {
      const a = m.get('none')!
      const b = m.get('int4')!
      lines.push(`| ${size} | ${f2(Math.max(...b.http.decode) / Math.max(...a.http.decode))} | ${f2(Math.min(...a.http.prefillMs) / Math.min(...b.http.prefillMs))} | ${f2(b.weightBytes / a.weightBytes)} | ${f2(b.peakRss / a.peakRss)} |`)
    }
  }
  return lines.join('\n')
}

if (args.child !== undefined) {
  const r = await runChild(args.child)
  process.stdout.write(JSON.stringify(r) + '\n')
} else {
  const sizes = args.sizes.split(',') as TestModelSize[]
  const quants = args.quants.split(',')
  const skip = new Set(args.skip.split(',').filter(s => s !== ''))
  console.log(`bench-engine: node ${process.version}, ${availableParallelism()} CPUs (${cpus()[0]?.model ?? '?'}), ${(totalmem() / 2 ** 30).toFixed(0)} GiB; onnxruntime CPU, 1 engine worker`)
  console.log(`decode: greedy, ${SHORT_PROMPT}-token prompt, ${TOKENS} tokens, ${REPS} reps alternating raw/HTTP; prefill: ${PREFILL}-token prompt, max_tokens 1`)
  console.log(`load average at start: ${loadAverage()} (other work on this machine shows up as noise); malloc: ${mallocSettings()}`)
  const rows: ChildResult[] = []
  const failed: string[] = []
  const started = performance.now()
  for (const size of sizes) {
    const dirs = await ensureModels(size, quants.filter(q => !skip.has(`${size}-${q}`)))
    for (const [quant, dir] of dirs) {
      const t = performance.now()
      try {
        const r = await spawnChild(dir)
        rows.push(r)
        console.error(`${r.model}: ${f1((performance.now() - t) / 1000)} s`)
      } catch (err) {
        failed.push(`${size}-${quant}: ${(err as Error).message}`)
      }
    }
  }
  for (const s of skip) console.log(`skipped: ${s}`)
  for (const f of failed) console.log(`FAILED: ${f}`)
  console.log('')
  console.log(table(rows))
  console.log('')
  console.log(`load average at end: ${loadAverage()}`)
  console.log(`total ${f1((performance.now() - started) / 1000)} s; shards in ${BENCH_DIR} (reused on the next run)`)
}
