/**
 * The KV cache kept in place (issue 11) against the stage runner of an earlier checkout, in one
 * process, step by step alternating: both runners load the same generated checkpoint compiled
 * by their own compiler (the earlier one fetches every present and takes it as the next past; this
 * one writes each step's new_key_values into a block with room), the same prompts, and decode
 * greedily side by side at a given context and batch size (the checkpoint: `--size`, 60m by default). int4 is compared with an f32 embedding
 * on this side too (`embedding: 'f32'`) so that only the KV handling differs and the logits must be
 * bit-identical (checked: the tokens every step); the default 4-bit embedding is timed as a third
 * column.
 *
 * Run (from the repository root, the earlier checkout e.g. `git worktree add /tmp/base 54fd5e3`
 * with node_modules linked):
 *   chrt -r 10 node reproduction/bench-kv-in-place.ts --base /tmp/base [--quants int4,none]
 *     [--contexts 16,256,1024] [--batches 1,8] [--steps 40] [--size 60m|tiny|250m]
 */
import { mkdir } from 'node:fs/promises'
import { existsSync } from 'node:fs'
import { cpus } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { createOnnxruntimeBackend, createStageRunner, GREEDY_PICK as GREEDY, stageInfoOf } from '../daemon/engine/index.ts'
import { compileShards, generateTestModel, loadManifest } from '../shards/index.ts'
import { loadAverage, lowerMedian } from './lib/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    base: { type: 'string' },
    quants: { type: 'string', default: 'int4,none' },
    contexts: { type: 'string', default: '16,256,1024' },
    batches: { type: 'string', default: '1,8' },
    steps: { type: 'string', default: '40' },
    size: { type: 'string', default: '60m' },
  },
})
if (args.base === undefined) throw new Error('--base DIR: a checkout of the commit to compare with')
const BASE = resolve(args.base)
const STEPS = Number(args.steps)
const WORK = resolve(import.meta.dirname, '..', '.cache', 'bench-kv-in-place')

interface Runner {
  open (id: string): void
  step (id: string, input: { kind: 'tokens', ids: BigInt64Array }, positions: BigInt64Array, keep: number, pick?: unknown): Promise<{ kind: string, id?: number }>
  stepBatch (items: unknown[]): Promise<Array<{ output?: { kind: string, id?: number }, error?: Error }>>
  drop (id: string, how: 'free'): Promise<void>
}
interface Side { name: string, runner: Runner }

const baseEngine = await import(join(BASE, 'daemon/engine/index.ts')) as typeof import('../daemon/engine/index.ts')
const baseShards = await import(join(BASE, 'shards/index.ts')) as typeof import('../shards/index.ts')


await mkdir(WORK, { recursive: true })
const SIZE = args.size as '60m' | 'tiny' | '250m'
const ckpt = join(WORK, `llama-${SIZE}`)
if (!existsSync(join(ckpt, 'config.json'))) await generateTestModel({ architecture: 'llama', outDir: ckpt, size: SIZE, seed: 1 })

async function side (name: string, engine: typeof baseEngine, dir: string): Promise<Side> {
  const manifest = await loadManifest(dir)
  const session = await engine.createOnnxruntimeBackend().load(join(dir, 'stage-0', 'model.onnx'), { device: 'CPU', threads: cpus().length })
  return { name, runner: engine.createStageRunner({ session, stage: engine.stageInfoOf(manifest), maxSequences: 16 }) as unknown as Runner }
}

console.log(`bench-kv-in-place: node ${process.version}, ${cpus().length} CPUs (${cpus()[0]?.model}); base ${BASE}; load ${loadAverage()}`)
console.log('\n| quant | batch | context | base ms/step | in place ms/step | in place / base | in place, 4-bit embedding ms/step | tokens equal |\n|---|---|---|---|---|---|---|---|')
for (const quant of args.quants.split(',') as Array<'int4' | 'none'>) {
  const baseDir = join(WORK, `${SIZE}-base-${quant}`)
  const hereDir = join(WORK, `${SIZE}-here-${quant}-f32emb`)
  const hereQ = join(WORK, `${SIZE}-here-${quant}`)
  if (!existsSync(join(baseDir, 'manifest.json'))) await baseShards.compileShards({ modelDir: ckpt, outDir: baseDir, quant })
  if (!existsSync(join(hereDir, 'manifest.json'))) await compileShards({ modelDir: ckpt, outDir: hereDir, quant, ...(quant === 'int4' ? { embedding: 'f32' as const } : {}) })
  if (quant === 'int4' && !existsSync(join(hereQ, 'manifest.json'))) await compileShards({ modelDir: ckpt, outDir: hereQ, quant })
  const sides = [await side('base', baseEngine, baseDir), await side('here', { createOnnxruntimeBackend, createStageRunner, stageInfoOf } as unknown as typeof baseEngine, hereDir)]
  if (quant === 'int4') sides.push(await side('here-q', { createOnnxruntimeBackend, createStageRunner, stageInfoOf } as unknown as typeof baseEngine, hereQ))
  for (const batch of args.batches.split(',').map(Number)) {
    for (const context of args.contexts.split(',').map(Number)) {
      const times = sides.map(() => [] as number[])
      const toks = sides.map(() => [] as number[])
      const ids = Array.from({ length: batch }, (_, b) => `s${b}`)
      for (const s of sides) {
        for (const [b, id] of ids.entries()) {
          s.runner.open(id)
          const prompt = BigInt64Array.from({ length: context }, (_, i) => BigInt(3 + ((i * 37 + b * 11) % 500)))
          await s.runner.step(id, { kind: 'tokens', ids: prompt }, BigInt64Array.from({ length: context }, (_, i) => BigInt(i)), 1)
        }
      }
      const next = sides.map(() => ids.map((_, b) => 5 + b))
      for (let t = 0; t < STEPS + 5; t++) {
        const order = t % 2 === 0 ? sides.map((_, i) => i) : sides.map((_, i) => sides.length - 1 - i)
        for (const i of order) {
          const s = sides[i]!
          const pos = BigInt64Array.of(BigInt(context + t))
          const began = performance.now()
          let picked: number[]
          if (batch === 1) {
            const out = await s.runner.step('s0', { kind: 'tokens', ids: BigInt64Array.of(BigInt(next[i]![0]!)) }, pos, 1, GREEDY)
            picked = [out.id!]
          } else {
            const outs = await s.runner.stepBatch(ids.map((id, b) => ({ seqId: id, input: { kind: 'tokens', ids: BigInt64Array.of(BigInt(next[i]![b]!)) }, positions: pos, logitsToKeep: 1, pick: GREEDY })))
            picked = outs.map(o => { if (o.output === undefined) throw o.error; return o.output.id! })
          }
          const ms = performance.now() - began
          if (t >= 5) times[i]!.push(ms)
          next[i] = picked
          toks[i]!.push(...picked)
        }
      }
      for (const s of sides) for (const id of ids) await s.runner.drop(id, 'free')
      const m = times.map(lowerMedian)
      const equal = toks[0]!.every((x, j) => x === toks[1]![j])
      console.log(`| ${quant} | ${batch} | ${context} | ${m[0]!.toFixed(2)} | ${m[1]!.toFixed(2)} | **${(m[1]! / m[0]!).toFixed(2)}** | ${m[2] === undefined ? '—' : m[2].toFixed(2)} | ${equal ? 'yes' : 'NO'} |`)
    }
  }
}
console.log(`\nload at end: ${loadAverage()}`)
