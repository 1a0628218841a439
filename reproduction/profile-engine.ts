/**
 * Where one decoded token's time goes, end to end: one streamed request (greedy unless
 * --temperature) through the daemon (createDaemon + the openai client, as bench-engine.ts) or the
 * bare engine loop (rawRun; on shoal's kernels where a node would run them, as the daemon's are), with
 * timestamps on the per-step path (SHOAL_TRACE_DIR: daemon/step-trace.ts) — main thread posts the
 * step, the worker receives it, builds feeds, onnxruntime runs, outputs are taken, the worker posts,
 * the main thread receives — and the client's arrival time of each token.
 *
 * Run: SHOAL_TRACE_DIR=/tmp/tr node reproduction/profile-engine.ts --shard .cache/bench/llama-tiny-int4
 *        [--mode http|raw] [--prompt 128] [--tokens 160] [--reps 3]
 *        [--streams N]   (http mode: N concurrent requests a window, so decode runs batch up to N rows)
 *        [--temperature T]   (http mode: the requests sample at T over the whole vocabulary, seeded, so no prompt
 *        lookup; the step then fetches the logits and draws in the worker: 0, greedy, by default)
 *        [--top-p P]   (with --temperature: the requests' top_p, default 1: the whole vocabulary)
 *        [--threads N]   (raw mode: onnxruntime's intra-op threads; default one per core)
 *        [--warmup 16] [--warmup-prompt N]   (the untimed first request: its tokens and prompt length, default --prompt;
 *        a fresh session runs its first few hundred steps slower, so a short warm-up times that too)
 * Prints the median and mean of each segment (the mean sets tokens per second) and each window's tok/s.
 * Add `--cpu-prof --cpu-prof-dir=DIR` to node for V8 profiles of both threads.
 */
import { mkdtemp, readdir, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { Session } from 'node:inspector/promises'
import { writeFile } from 'node:fs/promises'
import OpenAI from 'openai'
import { chooseStageGraphs, createStageEngine, GREEDY_PICK, resolveGraphChoice, stageInfoOf } from '../daemon/engine/index.ts'
import { dumpStepTrace } from '../daemon/step-trace.ts'
import { DEFAULT_BUDGETS } from '../daemon/node/index.ts'
import { loadManifest } from '../shards/index.ts'
import { benchDaemon, floorRank, loadAverage, lowerMedian, mean, promptIds } from './lib/index.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'
import { nodeKernels } from './lib/native-kernels.ts'

// The daemon and engine run in this process: with `shoal serve`'s malloc settings, as served.
execWithServeMalloc()

const { values: args } = parseArgs({ options: {
  shard: { type: 'string' }, mode: { type: 'string', default: 'http' }, prompt: { type: 'string', default: '128' },
  tokens: { type: 'string', default: '160' }, reps: { type: 'string', default: '3' }, warmup: { type: 'string', default: '16' }, 'warmup-prompt': { type: 'string' },
  'main-prof': { type: 'string' }, threads: { type: 'string' }, streams: { type: 'string', default: '1' }, temperature: { type: 'string', default: '0' }, 'top-p': { type: 'string', default: '1' },
} })
const dir = process.env.SHOAL_TRACE_DIR
if (dir === undefined || args.shard === undefined) throw new Error('SHOAL_TRACE_DIR and --shard are needed')
const PROMPT = Number(args.prompt)
const TOKENS = Number(args.tokens)
const STREAMS = Number(args.streams)
if (!(STREAMS >= 1) || (STREAMS > 1 && args.mode !== 'http')) throw new Error('--streams N (≥ 1) is for --mode http')
const TEMPERATURE = Number(args.temperature)
if (!(TEMPERATURE >= 0) || (TEMPERATURE > 0 && args.mode !== 'http')) throw new Error('--temperature T (≥ 0) is for --mode http')
/** A sampled request's fields: the whole vocabulary, and a seed (a seeded request decodes plainly, without prompt lookup). */
const TOP_P = Number(args['top-p'])
if (!(TOP_P > 0 && TOP_P <= 1)) throw new Error('--top-p P must be in (0, 1]')
const sampling = (salt: number): object => TEMPERATURE > 0 ? { temperature: TEMPERATURE, top_p: TOP_P, seed: salt } : { temperature: 0 }
const WARMUP = Number(args.warmup)
const WARMUP_PROMPT = args['warmup-prompt'] === undefined ? PROMPT : Number(args['warmup-prompt'])
const wall = (): number => performance.timeOrigin + performance.now()
const GREEDY = { pick: GREEDY_PICK }

const manifest = await loadManifest(args.shard)
const windows: Array<{ from: number, to: number, arrivals: number[] }> = []
const root = await mkdtemp(join(tmpdir(), 'shoal-profile-'))
if (args.mode === 'http') {
  // With `shoal serve`'s budgets (scripts/commands/serve.ts): a burst of --streams prompts queues
  // rather than being refused past the mesh's 1 s of expected wait.
  const daemon = benchDaemon(args.shard, root, { budgets: { ...DEFAULT_BUDGETS, batchBudgetMs: DEFAULT_BUDGETS.requestTimeoutMs } })
  const { apiUrl } = await daemon.start()
  const client = new OpenAI({ baseURL: `${apiUrl}/v1`, apiKey: 'p', maxRetries: 0 })
  const one = async (salt: number, n: number, promptLength: number, arrivals: number[]): Promise<void> => {
    const stream = await client.completions.create({ model: manifest.modelId, prompt: promptIds(promptLength, salt), max_tokens: n, ...sampling(salt), stream: true, return_token_ids: true } as OpenAI.CompletionCreateParamsStreaming)
    for await (const chunk of stream) {
      const got = (chunk.choices[0] as { token_ids?: number[] } | undefined)?.token_ids ?? []
      const t = wall()
      for (let i = 0; i < got.length; i++) arrivals.push(t)
    }
  }
  // --streams N: N concurrent requests a window (decode runs of up to N rows); their arrivals are
  // pooled, so the client's gaps and tok/s are the aggregate's.
  const run = async (salt: number, n: number, promptLength = PROMPT): Promise<{ from: number, to: number, arrivals: number[] }> => {
    const from = wall()
    const arrivals: number[] = []
    await Promise.all(Array.from({ length: STREAMS }, (_, k) => one(salt * STREAMS + k, n, promptLength, arrivals)))
    return { from, to: wall(), arrivals: arrivals.sort((a, b) => a - b) }
  }
  await run(99, WARMUP, WARMUP_PROMPT)
  const inspector = args['main-prof'] === undefined ? undefined : new Session()
  if (inspector !== undefined) { inspector.connect(); await inspector.post('Profiler.enable'); await inspector.post('Profiler.setSamplingInterval', { interval: 50 }); await inspector.post('Profiler.start') }
  for (let r = 0; r < Number(args.reps); r++) windows.push(await run(r, TOKENS))
  if (inspector !== undefined) { const { profile } = await inspector.post('Profiler.stop'); await writeFile(args['main-prof']!, JSON.stringify(profile)) }
  await daemon.stop()
} else {
  // shoal's kernels where a node would run them (as bench-engine.ts): without them the bare loop timed onnxruntime's int4 products and attention.
  const engine = createStageEngine({ ...resolveGraphChoice(args.shard, chooseStageGraphs(manifest, 0, 'CPU')), stage: stageInfoOf(manifest), backend: 'onnxruntime', device: 'CPU', ...(args.threads === undefined ? {} : { threads: Number(args.threads) }), ...await nodeKernels(manifest) })
  await engine.start()
  const run = async (salt: number, n: number, promptLength = PROMPT): Promise<{ from: number, to: number, arrivals: number[] }> => {
    const from = wall()
    const arrivals: number[] = []
    const prompt = promptIds(promptLength, salt)
    const seq = await engine.open()
    let out = await engine.step(seq, { tokenIds: prompt }, prompt.map((_, i) => i), GREEDY)
    arrivals.push(wall())
    for (let i = 1; i < n; i++) {
      if (out.kind !== 'token') throw new Error('no token')
      out = await engine.step(seq, { tokenIds: [out.id] }, [promptLength + i - 1], GREEDY)
      arrivals.push(wall())
    }
    await engine.free(seq)
    return { from, to: wall(), arrivals }
  }
  await run(99, WARMUP, WARMUP_PROMPT)
  for (let r = 0; r < Number(args.reps); r++) windows.push(await run(r, TOKENS))
  await engine.stop()
}
dumpStepTrace()
await new Promise(resolve => setTimeout(resolve, 200))

// ---- analysis: per decode step, the segments between consecutive marks
const files = (await readdir(dir)).filter(f => f.startsWith('trace-') && f.includes(`-${process.pid}-`))
const marks: Array<[string, number]> = []
for (const f of files) marks.push(...JSON.parse(await readFile(join(dir, f), 'utf8')) as Array<[string, number]>)
marks.sort((a, b) => a[1] - b[1])
const order = ['m.post', 'w.recv', 'ort.feeds', 'ort.run0', 'ort.run1', 'ort.out', 'w.post', 'm.recv']
const seg: Record<string, number[]> = {}
const periods: number[] = []
for (const w of windows) {
  const ms = marks.filter(([, t]) => t >= w.from && t <= w.to)
  // Steps: from one m.post to the next; skip the first (prefill) and keep only complete decode steps.
  const starts = ms.map((m, i) => m[0] === 'm.post' ? i : -1).filter(i => i >= 0)
  for (let k = 1; k + 1 < starts.length; k++) {
    const step = ms.slice(starts[k]!, starts[k + 1]! + 1)
    const labels = step.map(m => m[0])
    if (labels.filter(l => l === 'ort.run0').length !== 1) continue
    const at = (l: string): number => step.find(m => m[0] === l)![1]
    for (let i = 0; i + 1 < order.length; i++) (seg[`${order[i]} → ${order[i + 1]}`] ??= []).push(at(order[i + 1]!) - at(order[i]!))
    ;(seg['m.recv → next m.post'] ??= []).push(step.at(-1)![1] - at('m.recv'))
    const chain = ['m.recv', 'b.ran', 'b.obs', 'b.routed', 'g.tok', 'g.pushed', 'b.submit', 'b.kick', 'b.planned', 'b.exec', 'e.sb', 'm.post']
    // Each mark of the chain: the first occurrence after the previous one (the main thread's own order).
    let from = step.findIndex(m => m[0] === 'm.recv')
    const found: Array<number | undefined> = chain.map((l, i) => {
      if (i === chain.length - 1) return step.at(-1)![1]
      const j = step.findIndex((m, k) => k >= from && m[0] === l)
      if (j < 0) return undefined
      from = j
      return step[j]![1]
    })
    for (let i = 0; i + 1 < chain.length; i++) {
      const a = found[i]; const b = found[i + 1]
      if (a !== undefined && b !== undefined) (seg[`  main: ${chain[i]} → ${chain[i + 1]}`] ??= []).push(b - a)
    }
    periods.push(step.at(-1)![1] - step[0]![1])
  }
  // Run-ahead: the worker's period (one ORT run to the next) and how the main thread got each token.
  const runs = ms.filter(m => m[0] === 'ort.run0').map(m => m[1])
  ;(seg['worker: run start → next run start'] ??= []).push(...runs.slice(2).map((t, i) => t - runs[i + 1]!))
  const ends = ms.filter(m => m[0] === 'ort.run1').map(m => m[1])
  ;(seg['worker: session.run (run0 → run1)'] ??= []).push(...runs.slice(1).map((t, i) => ends[i + 1]! - t).filter(x => x > 0))
  ;(seg['worker: between runs (run1 → next run0)'] ??= []).push(...ends.slice(1, -1).map((t, i) => runs[i + 2]! - t).filter(x => x > 0))
  const count = (l: string): number => ms.filter(m => m[0] === l).length
  console.log(`window: ${count('w.ahead')} ahead posts, ${count('e.took')} tokens taken from run-ahead, ${count('e.wait')} waits for one, ${count('m.post')} step posts`)
  const gaps = w.arrivals.slice(2).map((t, i) => t - w.arrivals[i + 1]!)
  ;(seg['client: gap between tokens'] ??= []).push(...gaps)
}
const f3 = (x: number | undefined): string => x === undefined || Number.isNaN(x) ? '—' : x.toFixed(3)
console.log(`${manifest.modelId} mode=${args.mode} streams=${STREAMS} temperature=${TEMPERATURE} top_p=${TOP_P} prompt=${PROMPT} tokens=${TOKENS} reps=${args.reps} load=${loadAverage(2)} malloc: ${mallocSettings()}`)
// The mean is what sets tokens per second (the tail of slow steps counts); the median, a typical step.
console.log(`| segment | median ms | mean | p10 | p90 | n |`)
console.log('|---|---|---|---|---|---|')
for (const [k, xs] of Object.entries(seg)) console.log(`| ${k} | ${f3(lowerMedian(xs))} | ${f3(mean(xs))} | ${f3(floorRank(xs, 0.1))} | ${f3(floorRank(xs, 0.9))} | ${xs.length} |`)
console.log(`| whole step (m.post → next m.post) | ${f3(lowerMedian(periods))} | ${f3(mean(periods))} | ${f3(floorRank(periods, 0.1))} | ${f3(floorRank(periods, 0.9))} | ${periods.length} |`)
const tokS = windows.map(w => (w.arrivals.length - 1) / ((w.arrivals.at(-1)! - w.arrivals[0]!) / 1000))
console.log(`decode tok/s per window, first to last token: ${tokS.map(x => x.toFixed(0)).join(' ')}`)
await rm(root, { recursive: true, force: true })
