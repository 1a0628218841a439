/**
 * What shoal's int4 kernel is worth to an expert-parallel MoE model: one expert's graph (a holder's
 * unit of work: one run per expert per group of rows) and one MoE layer's stage graph (attention,
 * router; at one row, as each sequence's attention runs), each made twice on the same session
 * worker the holder and the stage use (engine/off-thread-sessions.ts, one intra-op thread as they
 * run) — onnxruntime's MatMulNBits, and shoal's MatMulQ4 swapped in at load as nodes do
 * (`--kernels auto`) — and timed alternately on the same feeds: per rows, each side's median run
 * and the median of the rounds' ratios (plain ÷ kernel: above 1, the kernel is faster).
 *
 *   node reproduction/bench-expert-kernels.ts [--arch qwen3-moe] [--size small] [--rows 1,2,8,32]
 *        [--rounds 15] [--runs 20]
 */
import { existsSync } from 'node:fs'
import { rename } from 'node:fs/promises'
import { availableParallelism } from 'node:os'
import { join, resolve } from 'node:path'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import { createOffThreadSessions, prepareNativeKernels } from '../daemon/engine/index.ts'
import type { OffThreadSession } from '../daemon/engine/index.ts'
import { compileExpertShards, generateTestModel } from '../shards/index.ts'
import { openExpertShards } from '../daemon/experts/index.ts'
import type { MoeTestArchitecture, TestModelSize } from '../shards/index.ts'
import { gitDescribe, loadAverage, lscpuModel, median } from './lib/index.ts'

const { values } = parseArgs({
  options: {
    arch: { type: 'string', default: 'qwen3-moe' },
    size: { type: 'string', default: 'small' },
    rows: { type: 'string', default: '1,2,8,32' },
    rounds: { type: 'string', default: '15' },
    runs: { type: 'string', default: '20' },
  },
})
const REPO = resolve(import.meta.dirname, '..')
const CACHE = join(REPO, '.cache', 'bench-expert-kernels')
const arch = values.arch as MoeTestArchitecture
const size = values.size as TestModelSize
const ROWS = values.rows.split(',').map(Number)
const ROUNDS = Number(values.rounds)
const RUNS = Number(values.runs)

const loadStart = loadAverage(2)
const ckpt = join(CACHE, `${arch}-${size}`)
const dir = join(CACHE, `${arch}-${size}-experts-int4`)
if (!existsSync(ckpt)) { await generateTestModel({ architecture: arch, size, outDir: `${ckpt}.tmp`, seed: 4 }); await rename(`${ckpt}.tmp`, ckpt) }
if (!existsSync(dir)) { await compileExpertShards({ modelDir: ckpt, outDir: `${dir}.tmp`, quant: 'int4' }); await rename(`${dir}.tmp`, dir) }
const shards = await openExpertShards(dir)
const kernels = await prepareNativeKernels(join(REPO, '.cache', 'kernels'))
if (!('lib' in kernels)) throw new Error(`shoal's kernels are off here: ${kernels.off}`)
const moeLayer = shards.layout.layers.find(l => l.experts !== undefined && l.experts.length > 0)!
const { hiddenSize: D, numKvHeads: kvH, headDim: hd } = shards.layout.shape
const host = createOffThreadSessions()
let seed = 11
const rand = (): number => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648 - 0.5 }
const f32 = (dims: number[]): ort.Tensor => new ort.Tensor('float32', Float32Array.from({ length: dims.reduce((a, b) => a * b, 1) }, rand), dims)
const i64 = (v: number[], dims: number[]): ort.Tensor => new ort.Tensor('int64', BigInt64Array.from(v.map(BigInt)), dims)

/** Alternating rounds of `runs` runs each on the two sessions: medians (ms a run) and the median ratio. */
async function compare (plain: OffThreadSession, kernel: OffThreadSession, feeds: Record<string, ort.Tensor>): Promise<{ plain: number, kernel: number, ratio: number }> {
  await plain.time(feeds, 3)
  await kernel.time(feeds, 3)
  const a: number[] = []
  const b: number[] = []
  const ratios: number[] = []
  for (let r = 0; r < ROUNDS; r++) {
    const order = r % 2 === 0 ? [plain, kernel] : [kernel, plain]
    const t: number[] = []
    for (const s of order) t.push(median(await s.time(feeds, RUNS)))
    const [p, k] = r % 2 === 0 ? [t[0]!, t[1]!] : [t[1]!, t[0]!]
    a.push(p); b.push(k); ratios.push(p / k)
  }
  return { plain: median(a), kernel: median(b), ratio: median(ratios) }
}

const lines: string[] = []
const expertPath = join(dir, ...moeLayer.experts![0]!.split('/'))
const expert = { plain: await host.create(expertPath, { threads: 1 }), kernel: await host.create(expertPath, { threads: 1, kernels: kernels.lib }) }
for (const rows of ROWS) {
  const r = await compare(expert.plain, expert.kernel, { rows: f32([rows, D]) })
  lines.push(`| expert (layer ${moeLayer.layer}) | ${rows} | ${r.plain.toFixed(3)} | ${r.kernel.toFixed(3)} | **${r.ratio.toFixed(3)}** |`)
  console.error(lines.at(-1))
}
const layerPath = join(dir, ...moeLayer.graph.split('/'))
const layer = { plain: await host.create(layerPath, { threads: 1 }), kernel: await host.create(layerPath, { threads: 1, kernels: kernels.lib }) }
const past = 128
const layerFeeds: Record<string, ort.Tensor> = {}
for (const name of layer.plain.inputNames) {
  if (name.startsWith('past_key_values')) layerFeeds[name] = f32([1, kvH, past, hd])
  else if (name === 'position_ids') layerFeeds[name] = i64([past], [1, 1])
  else if (name === 'attention_mask') layerFeeds[name] = i64(new Array<number>(past + 1).fill(1), [1, past + 1])
  else layerFeeds[name] = f32([1, 1, D])
}
const r = await compare(layer.plain, layer.kernel, layerFeeds)
lines.push(`| stage layer ${moeLayer.layer} (attention, router; ${past} past positions) | 1 | ${r.plain.toFixed(3)} | ${r.kernel.toFixed(3)} | **${r.ratio.toFixed(3)}** |`)
await host.close()

console.log([
  `- command: node reproduction/bench-expert-kernels.ts ${process.argv.slice(2).join(' ')}`,
  `- model: ${arch} ${size} (hidden ${D}, ${shards.layout.shape.moe!.numExperts} experts of width ${shards.layout.shape.moe!.expertIntermediateSize}), expert-parallel shards, int4 block 32, int8 activations`,
  `- machine: ${lscpuModel()}, ${availableParallelism()} CPUs; Node ${process.version}; git ${gitDescribe(REPO)}`,
  `- ${ROUNDS} alternating rounds of ${RUNS} runs a side on the session worker, one intra-op thread; load average at start ${loadStart}, at end ${loadAverage(2)}`,
  '',
  '| graph | rows | MatMulNBits ms a run | shoal\'s kernel ms a run | MatMulNBits ÷ kernel |',
  '|---|---:|---:|---:|---:|',
  ...lines,
].join('\n'))
