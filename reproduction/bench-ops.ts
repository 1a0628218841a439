/**
 * Op table speed: the same random-weight Llama checkpoints compiled with the 'standard' and the
 * 'ort-contrib' op table, fp32 and int4, run side by side through onnxruntime-node (CPU, session
 * options as the engine's backend: optimisation 'all', intra-op threads = cores, no spinning).
 *
 * Per model and quantization it measures, batch 1:
 *   decode @16    one new token with 16 cached positions (ms per step, median)
 *   decode @512   one new token with 512 cached positions
 *   prefill 512   512 new tokens, empty cache, logits for the last position only
 * Each step runs at a fixed context (the same past tensors every repetition), and the two op
 * tables alternate repetition by repetition so machine noise hits both alike. Reported: median
 * wall time, and median process CPU time (user + system, all threads: intra-op threads do not
 * spin, so this is the work a step costs, less sensitive to other load on a shared machine).
 *
 * Run: node reproduction/bench-ops.ts [--sizes 60m,250m] [--quant none,int4] [--reps 30]
 *      [--threads N] [--cache DIR]   (checkpoints and shards are cached under DIR, default .cache/bench-ops)
 */
import { existsSync } from 'node:fs'
import { rm } from 'node:fs/promises'
import { availableParallelism, cpus } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import {
  ATTENTION_MASK, compileShards, generateTestModel, INPUT_IDS, loadManifest, LOGITS, NUM_LOGITS_TO_KEEP,
  newKeyName, newValueName, pastKeyName, pastValueName, POSITION_IDS, presentKeyName, presentValueName, COMPILER_VERSION,
  type ShardManifest, type TestModelSize,
} from '../shards/index.ts'
import { upperMedian } from './lib/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values } = parseArgs({
  options: {
    sizes: { type: 'string', default: '60m,250m' },
    quant: { type: 'string', default: 'none,int4' },
    reps: { type: 'string', default: '30' },
    threads: { type: 'string' },
    cache: { type: 'string', default: '.cache/bench-ops' },
  },
})
const SIZES = values.sizes.split(',') as TestModelSize[]
const QUANTS = values.quant.split(',') as Array<'none' | 'int4'>
const REPS = Number(values.reps)
const THREADS = values.threads !== undefined ? Number(values.threads) : availableParallelism()
const CACHE = resolve(values.cache)
const OP_SETS = ['standard', 'ort-contrib'] as const
type OpSet = typeof OP_SETS[number]

async function shardsFor (size: TestModelSize, quant: 'none' | 'int4', opSet: OpSet): Promise<{ dir: string, manifest: ShardManifest }> {
  const modelDir = join(CACHE, `llama-${size}`)
  if (!existsSync(join(modelDir, 'config.json'))) {
    await rm(modelDir, { recursive: true, force: true })
    await generateTestModel({ architecture: 'llama', size, outDir: modelDir, seed: 1 })
  }
  const dir = join(CACHE, `llama-${size}-${quant}-${opSet}`)
  if (existsSync(join(dir, 'manifest.json'))) {
    const m = await loadManifest(dir)
    if (m.compilerVersion === COMPILER_VERSION) return { dir, manifest: m }
  }
  await rm(dir, { recursive: true, force: true })
  const t0 = performance.now()
  const manifest = await compileShards({ modelDir, outDir: dir, quant, opSet })
  console.error(`compiled ${size} ${quant} ${opSet} in ${((performance.now() - t0) / 1000).toFixed(1)} s`)
  return { dir, manifest }
}

const i64 = (v: number[], dims: number[]): ort.Tensor => new ort.Tensor('int64', BigInt64Array.from(v.map(BigInt)), dims)

interface Runner {
  /** Feeds for S new tokens after a cache of P positions (past filled from a real prefill). */
  feeds: (P: number, S: number) => Promise<Record<string, ort.Tensor>>
  /** Wall ms and process CPU ms (all threads; intra-op threads do not spin, so this is work done). */
  run: (feeds: Record<string, ort.Tensor>) => Promise<[number, number]>
  release: () => Promise<void>
}

async function openRunner (dir: string, m: ShardManifest): Promise<Runner> {
  const stage = m.stages[0]!
  const session = await ort.InferenceSession.create(join(dir, stage.graph), {
    graphOptimizationLevel: 'all',
    intraOpNumThreads: THREADS,
    interOpNumThreads: 1,
    executionMode: 'sequential',
    extra: { session: { intra_op: { allow_spinning: '0' } } },
  })
  const { numKvHeads: kvH, headDim: hd, numLayers: L, vocabSize: V } = m.shape
  const empty = (): ort.Tensor => new ort.Tensor('float32', new Float32Array(0), [1, kvH, 0, hd])
  const ids = (n: number, from: number): number[] => Array.from({ length: n }, (_, i) => 3 + ((from + i) * 7919) % (V - 3))
  const base = (P: number, S: number, past: (l: number, kind: 'k' | 'v') => ort.Tensor): Record<string, ort.Tensor> => {
    const f: Record<string, ort.Tensor> = {
      [INPUT_IDS]: i64(ids(S, P), [1, S]),
      [POSITION_IDS]: i64(Array.from({ length: S }, (_, i) => P + i), [1, S]),
      [ATTENTION_MASK]: i64(new Array<number>(P + S).fill(1), [1, P + S]),
      [NUM_LOGITS_TO_KEEP]: i64([1], []),
    }
    for (let l = 0; l < L; l++) {
      f[pastKeyName(l)] = past(l, 'k')
      f[pastValueName(l)] = past(l, 'v')
    }
    return f
  }
  return {
    feeds: async (P, S) => {
      if (P === 0) return base(0, S, () => empty())
      const out = await session.run(base(0, P, () => empty()))
      // From an empty past, a graph's new columns (ort-contrib, compiler ≥ 6: no present) are the whole cache.
      return base(P, S, (l, kind) => (out[kind === 'k' ? presentKeyName(l) : presentValueName(l)] ?? out[kind === 'k' ? newKeyName(l) : newValueName(l)])!)
    },
    run: async (feeds) => {
      const c0 = process.cpuUsage()
      const t0 = performance.now()
      const out = await session.run(feeds)
      const ms = performance.now() - t0
      const c = process.cpuUsage(c0)
      if (out[LOGITS] === undefined) throw new Error('no logits')
      return [ms, (c.user + c.system) / 1000]
    },
    release: async () => { await session.release() },
  }
}

const CASES = [
  { name: 'decode @16', P: 16, S: 1, reps: (r: number) => r },
  { name: 'decode @512', P: 512, S: 1, reps: (r: number) => r },
  { name: 'prefill 512', P: 0, S: 512, reps: (r: number) => Math.max(3, Math.ceil(r / 6)) },
]

const rows: string[] = []
for (const size of SIZES) {
  for (const quant of QUANTS) {
    const runners = new Map<OpSet, Runner>()
    for (const opSet of OP_SETS) {
      const { dir, manifest } = await shardsFor(size, quant, opSet)
      runners.set(opSet, await openRunner(dir, manifest))
    }
    for (const c of CASES) {
      const feeds = new Map<OpSet, Record<string, ort.Tensor>>()
      for (const opSet of OP_SETS) {
        const r = runners.get(opSet)!
        const f = await r.feeds(c.P, c.S)
        feeds.set(opSet, f)
        await r.run(f) // warm-up
      }
      const wall = new Map<OpSet, number[]>(OP_SETS.map(o => [o, []]))
      const cpu = new Map<OpSet, number[]>(OP_SETS.map(o => [o, []]))
      for (let i = 0; i < c.reps(REPS); i++) {
        for (const opSet of i % 2 === 0 ? OP_SETS : [...OP_SETS].reverse()) {
          const [w, u] = await runners.get(opSet)!.run(feeds.get(opSet)!)
          wall.get(opSet)!.push(w)
          cpu.get(opSet)!.push(u)
        }
      }
      const [sw, cw, su, cu] = [upperMedian(wall.get('standard')!), upperMedian(wall.get('ort-contrib')!), upperMedian(cpu.get('standard')!), upperMedian(cpu.get('ort-contrib')!)]
      const row = `| ${size} | ${quant === 'none' ? 'fp32' : 'int4'} | ${c.name} | ${sw.toFixed(2)} | ${cw.toFixed(2)} | ${(sw / cw).toFixed(2)}× | ${su.toFixed(2)} | ${cu.toFixed(2)} | ${(su / cu).toFixed(2)}× |`
      rows.push(row)
      console.error(row)
    }
    for (const r of runners.values()) await r.release()
  }
}

console.log(`onnxruntime-node ${ort.env.versions.common}, Node ${process.version}, ${cpus()[0]?.model ?? 'cpu'} × ${cpus().length}, intra-op threads ${THREADS}, reps ${REPS} (prefill ${CASES[2]!.reps(REPS)}), medians`)
console.log('')
console.log('| model | weights | case | standard wall ms | contrib wall ms | wall ratio | standard CPU ms | contrib CPU ms | CPU ratio |')
console.log('|---|---|---|---:|---:|---:|---:|---:|---:|')
for (const r of rows) console.log(r)
