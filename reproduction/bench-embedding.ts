/**
 * What quantizing the token embedding costs and saves in int4 shards (compiler 5's default,
 * `quantization.embedding: 'int4'`, against `--f32-embedding`), on generated Llama checkpoints
 * (random weights, real shapes):
 *  - accuracy (`--accuracy SIZE`): for a few prompts, greedy 64-token continuations and the
 *    teacher-forced logits over prompt + fp32 continuation, of int4 with the 4-bit embedding, int4
 *    with the f32 embedding and fp32, at accuracy level 4 (int8 activations, the default) and 0
 *    (f32 activations): token agreement (and identical prefix) and max / mean |Δlogit|;
 *  - memory (`--memory SIZES`): shard bytes, and the peak RSS of a bare stage engine
 *    (createStageEngine: the worker thread and onnxruntime session the daemon runs) over a
 *    128-token prefill and 32 decode steps, each configuration in its own child process.
 * No assertions: a measurement.
 *
 * Run: node reproduction/bench-embedding.ts [--accuracy 60m] [--memory 60m,250m] [--prompts 4]
 *        [--ckpt-dir DIR]   (where llama-SIZE checkpoints are, or are generated; default .cache/bench)
 * Shards are compiled into .cache/bench-embedding/ and reused.
 */
import { spawn } from 'node:child_process'
import { existsSync } from 'node:fs'
import { mkdir, readFile, rename } from 'node:fs/promises'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { createStageEngine, GREEDY_PICK, stageInfoOf } from '../daemon/engine/index.ts'
import { compileShards, generateTestModel, loadManifest, type TestModelSize } from '../shards/index.ts'
// The test suite's direct onnxruntime pipeline: logits of every step, no engine in between.
import { greedyDecode, openPipeline, prefill } from '../test/shards/pipeline.ts'
import { promptIds, tokenOf } from './lib/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    accuracy: { type: 'string', default: '60m' },
    memory: { type: 'string', default: '60m,250m' },
    prompts: { type: 'string', default: '4' },
    'ckpt-dir': { type: 'string' },
    child: { type: 'string' },
  },
})
const CKPT_DIR = resolve(args['ckpt-dir'] ?? join(import.meta.dirname, '..', '.cache', 'bench'))
const OUT_DIR = resolve(import.meta.dirname, '..', '.cache', 'bench-embedding')
const N = 64

interface Variant { name: string, quant: 'none' | 'int4', accuracyLevel?: 0 | 4, embedding?: 'int4' | 'f32' }
const VARIANTS: Variant[] = [
  { name: 'fp32', quant: 'none' },
  { name: 'int4-acc4-embq4', quant: 'int4', accuracyLevel: 4, embedding: 'int4' },
  { name: 'int4-acc4-embf32', quant: 'int4', accuracyLevel: 4, embedding: 'f32' },
  { name: 'int4-acc0-embq4', quant: 'int4', accuracyLevel: 0, embedding: 'int4' },
  { name: 'int4-acc0-embf32', quant: 'int4', accuracyLevel: 0, embedding: 'f32' },
]

/** Deterministic prompt token ids inside the test tokenizer's 512 real tokens (as bench-engine). */
const mb = (b: number): string => (b / 2 ** 20).toFixed(1)

async function checkpoint (size: TestModelSize): Promise<string> {
  const ckpt = join(CKPT_DIR, `llama-${size}`)
  if (!existsSync(join(ckpt, 'config.json'))) {
    await mkdir(CKPT_DIR, { recursive: true })
    const tmp = `${ckpt}.tmp-${process.pid}`
    await generateTestModel({ architecture: 'llama', size, outDir: tmp, seed: 1, modelId: `llama-${size}` })
    await rename(tmp, ckpt)
  }
  return ckpt
}

async function shards (size: TestModelSize, v: Variant): Promise<string> {
  const dir = join(OUT_DIR, `llama-${size}-${v.name}`)
  if (!existsSync(join(dir, 'manifest.json'))) {
    await mkdir(OUT_DIR, { recursive: true })
    const t = performance.now()
    const tmp = `${dir}.tmp-${process.pid}`
    await compileShards({
      modelDir: await checkpoint(size),
      outDir: tmp,
      quant: v.quant,
      ...(v.accuracyLevel !== undefined ? { accuracyLevel: v.accuracyLevel } : {}),
      ...(v.embedding !== undefined ? { embedding: v.embedding } : {}),
    })
    await rename(tmp, dir)
    console.error(`compiled ${dir} in ${((performance.now() - t) / 1000).toFixed(1)} s`)
  }
  return dir
}

// ---------------------------------------------------------------- accuracy

interface Run { tokens: number[][], forced: Float32Array[] }

async function runVariant (dir: string, prompts: number[][], reference?: Run): Promise<Run> {
  const m = await loadManifest(dir)
  const p = await openPipeline(dir, m)
  try {
    const tokens: number[][] = []
    const forced: Float32Array[] = []
    for (const [i, prompt] of prompts.entries()) {
      const r = await greedyDecode(p, prompt, N)
      tokens.push(r.tokens)
      // Teacher-forced on the reference's continuation, so every position compares the same context.
      const cont = (reference ?? { tokens }).tokens[i]!
      forced.push((await prefill(p, [[...prompt, ...cont]], 0)).logits)
    }
    return { tokens, forced }
  } finally {
    await p.release()
  }
}

function compare (a: Run, b: Run): { agree: number, total: number, prefixes: number[], maxErr: number, meanErr: number } {
  let agree = 0
  let total = 0
  const prefixes: number[] = []
  for (const [i, ta] of a.tokens.entries()) {
    const tb = b.tokens[i]!
    agree += ta.filter((t, j) => t === tb[j]).length
    total += ta.length
    let p = 0
    while (p < ta.length && ta[p] === tb[p]) p++
    prefixes.push(p)
  }
  let maxErr = 0
  let sum = 0
  let n = 0
  for (const [i, fa] of a.forced.entries()) {
    const fb = b.forced[i]!
    for (let j = 0; j < fa.length; j++) { const d = Math.abs(fa[j]! - fb[j]!); maxErr = Math.max(maxErr, d); sum += d; n++ }
  }
  return { agree, total, prefixes, maxErr, meanErr: sum / n }
}

async function accuracy (size: TestModelSize, nPrompts: number): Promise<void> {
  const prompts = Array.from({ length: nPrompts }, (_, i) => promptIds(16, i + 1))
  const fp32 = await runVariant(await shards(size, VARIANTS[0]!), prompts)
  const runs = new Map<string, Run>()
  for (const v of VARIANTS.slice(1)) runs.set(v.name, await runVariant(await shards(size, v), prompts, fp32))
  console.log(`\n### Accuracy, ${size}: ${nPrompts} prompts × ${N} greedy tokens; |Δlogit| teacher-forced over prompt (16) + fp32 continuation (${N}) = ${(16 + N) * nPrompts} positions × vocab\n`)
  console.log('| shards | vs | greedy agreement | identical prefix per prompt | max \\|Δlogit\\| | mean \\|Δlogit\\| |')
  console.log('|---|---|---|---|---|---|')
  const row = (name: string, vs: string, c: ReturnType<typeof compare>): void => {
    console.log(`| ${name} | ${vs} | ${c.agree}/${c.total} | ${c.prefixes.join(', ')} | ${c.maxErr.toFixed(4)} | ${c.meanErr.toFixed(4)} |`)
  }
  for (const acc of [4, 0]) {
    const q = runs.get(`int4-acc${acc}-embq4`)!
    const f = runs.get(`int4-acc${acc}-embf32`)!
    row(`int4 acc${acc}, 4-bit embedding`, 'fp32', compare(q, fp32))
    row(`int4 acc${acc}, f32 embedding`, 'fp32', compare(f, fp32))
    // Against the f32-embedding int4 shards, teacher-forced on the fp32 continuation too.
    row(`int4 acc${acc}, 4-bit embedding`, `int4 acc${acc}, f32 embedding`, compare(q, f))
  }
}

// ---------------------------------------------------------------- memory

interface MemResult {
  dir: string
  weightBytes: number
  baselineRss: number
  loadedRss: number
  peakRss: number
  /** After the run (Linux /proc): anonymous and file-backed resident bytes, and how much of the shard's weights file is resident through a mapping. */
  rssAnon: number
  rssFile: number
  dataMapped: number
  dataMappedRss: number
}

/** Resident memory by kind, and the shard weights file's mappings (onnxruntime maps external data). */
async function residency (dataFile: string): Promise<Pick<MemResult, 'rssAnon' | 'rssFile' | 'dataMapped' | 'dataMappedRss'>> {
  const kb = (text: string, key: string): number => Number(new RegExp(`^${key}:\\s+(\\d+) kB`, 'm').exec(text)?.[1] ?? NaN) * 1024
  const status = await readFile('/proc/self/status', 'utf8').catch(() => '')
  const smaps = await readFile('/proc/self/smaps', 'utf8').catch(() => '')
  let dataMapped = 0
  let dataMappedRss = 0
  // Each mapping: a header line (address range … path), then its Size:/Rss: lines.
  for (const block of smaps.split(/\n(?=[0-9a-f]+-[0-9a-f]+ )/)) {
    if (!block.split('\n', 1)[0]!.endsWith(dataFile)) continue
    dataMapped += kb(block, 'Size')
    dataMappedRss += kb(block, 'Rss')
  }
  return { rssAnon: kb(status, 'RssAnon'), rssFile: kb(status, 'RssFile'), dataMapped, dataMappedRss }
}

const GREEDY = { pick: GREEDY_PICK }

async function memoryChild (dir: string): Promise<MemResult> {
  const manifest = await loadManifest(dir)
  const stage = manifest.stages[0]!
  const weightBytes = manifest.stages.reduce((a, s) => a + s.files.reduce((b, f) => b + f.bytes, 0), 0)
  const baselineRss = process.memoryUsage().rss
  const engine = createStageEngine({ graphPath: join(dir, ...stage.graph.split('/')), stage: stageInfoOf(manifest), backend: 'onnxruntime', device: 'CPU' })
  await engine.start()
  const loadedRss = process.memoryUsage().rss
  let res: Awaited<ReturnType<typeof residency>> = { rssAnon: NaN, rssFile: NaN, dataMapped: NaN, dataMappedRss: NaN }
  try {
    const prompt = promptIds(128)
    const seq = await engine.open()
    let token = tokenOf(await engine.step(seq, { tokenIds: prompt }, prompt.map((_, i) => i), GREEDY))
    for (let i = 1; i < 32; i++) token = tokenOf(await engine.step(seq, { tokenIds: [token] }, [prompt.length + i - 1], GREEDY))
    await engine.free(seq)
    res = await residency(join(dir, ...stage.graph.split('/')) + '.data')
  } finally {
    await engine.stop()
  }
  return { dir, weightBytes, baselineRss, loadedRss, peakRss: process.resourceUsage().maxRSS * 1024, ...res }
}

async function spawnChild (dir: string): Promise<MemResult> {
  const child = spawn(process.execPath, [import.meta.filename, '--child', dir], { stdio: ['ignore', 'pipe', 'inherit'] })
  let stdout = ''
  child.stdout.setEncoding('utf8').on('data', (s: string) => { stdout += s })
  const code = await new Promise<number | null>(resolve => child.once('exit', resolve))
  if (code !== 0) throw new Error(`child for ${dir} exited ${code}`)
  return JSON.parse(stdout.trim().split('\n').at(-1)!) as MemResult
}

async function memory (sizes: TestModelSize[]): Promise<void> {
  const rows: string[] = []
  for (const size of sizes) {
    for (const v of VARIANTS.filter(x => x.quant === 'int4' && x.accuracyLevel === 4)) {
      const r = await spawnChild(await shards(size, v))
      rows.push(`| ${size} ${v.name} | ${mb(r.weightBytes)} | ${mb(r.baselineRss)} | ${mb(r.loadedRss)} | ${mb(r.peakRss)} | ${mb(r.peakRss - r.baselineRss)} | ${(r.peakRss / r.weightBytes).toFixed(2)} | ${((r.peakRss - r.baselineRss) / r.weightBytes).toFixed(2)} | ${mb(r.rssAnon)} / ${mb(r.rssFile)} | ${mb(r.dataMapped)} / ${mb(r.dataMappedRss)} |`)
    }
  }
  console.log('\n### Memory: bare stage engine, 128-token prefill + 32 decode steps, one child process each\n')
  console.log('| shards | shard bytes MB | baseline RSS MB | RSS after load MB | peak RSS MB | peak − baseline MB | peak / shard bytes | (peak − baseline) / shard bytes | after the run: RSS anon / file MB | weights file mapped / resident MB |')
  console.log('|---|---|---|---|---|---|---|---|---|---|')
  for (const r of rows) console.log(r)
}

if (args.child !== undefined) {
  process.stdout.write(`${JSON.stringify(await memoryChild(args.child))}\n`)
} else {
  const sizes = (s: string): TestModelSize[] => s.split(',').map(x => x.trim()).filter(x => x !== '') as TestModelSize[]
  for (const size of sizes(args.accuracy)) await accuracy(size, Number(args.prompts))
  if (sizes(args.memory).length > 0) await memory(sizes(args.memory))
}
