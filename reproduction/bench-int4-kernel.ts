/**
 * The int4 products of a step by themselves, onnxruntime's MatMulNBits against shoal's MatMulQ4
 * (daemon/engine/native/q4-matmul.h; issue 11, docs/engine-notes.md waves 35–36): the 60m
 * shape's 33 (8 layers' qkv, o, gate_up and down, and the 32,000-row head; `--no-head` without it)
 * or the 250m shape's 65, random int4 weights in blocks of 32, int8 activations (accuracy level 4),
 * for M rows. Two sessions in one process, the same weights and feeds, timed alternately with the
 * engine's session options (graph optimisation 'all', sequential, intra-op threads spinning only
 * within a run) and `shoal serve`'s malloc settings. The kernel comes in by `process.dlopen` of the library after
 * onnxruntime-node is loaded (its Node addon entry, as nodes load it: daemon/engine/native), so
 * every session made after knows MatMulQ4.
 *
 * Each product's output is reduced to one number a row in the graph, so that the run returns a
 * few bytes: what is timed is the products (and 33 small reductions, alike on both sides).
 *
 *   node reproduction/bench-int4-kernel.ts [--size 60m|250m] [--rows 1,2,4,8,16,128] [--threads 2]
 *     [--rounds 4] [--runs 40] [--no-head]
 * Run it as the other benchmarks (`chrt -r 10 node …`, nothing else on the machine). Prints, for
 * each M, both sides' median ms a run over all rounds and their ratio, and the largest difference
 * between the two sides' reduced sums at M = 8 relative to the largest (the kernels round
 * activations alike and sum in another order).
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import { sessionOptions } from '../daemon/engine/backend/onnxruntime.ts'
import { NATIVE_KERNEL_DOMAIN } from '../shards/contract.ts'
import { DT, GraphBuilder, MS_DOMAIN } from '../shards/graph/builder.ts'
import { quantizeMatrix } from '../shards/quant.ts'
import { gitDescribe, loadAverage, lscpuModel, median } from './lib/index.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'
import { buildNativeKernels } from './lib/native-kernels.ts'

// The sessions run in this process: with `shoal serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: '60m' },
    rows: { type: 'string', default: '1,2,4,8,16,128' },
    threads: { type: 'string', default: '2' },
    rounds: { type: 'string', default: '4' },
    runs: { type: 'string', default: '40' },
    'no-head': { type: 'boolean', default: false },
  },
})
const SHAPES: Record<string, { D: number, F: number, KV: number, L: number }> = {
  '60m': { D: 512, F: 1536, KV: 128, L: 8 },
  '250m': { D: 1024, F: 2816, KV: 256, L: 16 },
}
const shape = SHAPES[args.size]
if (shape === undefined) throw new Error(`--size ${args.size}: one of ${Object.keys(SHAPES).join(', ')}`)
const { D, F, KV, L } = shape
const VOCAB = 32000
const BLOCK = 32
const rowsList = args.rows.split(',').map(Number)

// [K, N] of each product, in a step's order.
const products: Array<[number, number]> = []
for (let l = 0; l < L; l++) products.push([D, D + 2 * KV], [D, D], [D, 2 * F], [F, D])
if (!args['no-head']) products.push([D, VOCAB])

// A fixed generator, so both sides and every run see the same numbers.
let seed = 1
const uniform = (n: number): Float32Array => {
  const a = new Float32Array(n)
  for (let i = 0; i < n; i++) { seed = (seed * 1664525 + 1013904223) >>> 0; a[i] = seed / 2 ** 32 - 0.5 }
  return a
}
const weights = products.map(([k, n]) => quantizeMatrix(uniform(k * n), n, k, 4, BLOCK))

/** The products as one graph, each as `op`: its output reduced to [M, 1] and the reductions added. */
function graph (dir: string, op: 'MatMulNBits' | 'MatMulQ4'): string {
  const g = new GraphBuilder(`${op}.onnx.data`)
  const x = g.input('x', DT.FLOAT, ['M', D])
  const h = g.input('h', DT.FLOAT, ['M', F])
  let sum: string | undefined
  products.forEach(([k, n], i) => {
    const q = weights[i]!
    const w = g.weight(`w${i}`, DT.UINT8, [n, k / BLOCK, BLOCK / 2], q.data)
    const s = g.f32Weight(`s${i}`, [n * k / BLOCK], q.scales)
    const y = g.op(op, `mm${i}`, [k === F ? h : x, w, s], { K: k, N: n, bits: 4, block_size: BLOCK, accuracy_level: 4 },
      op === 'MatMulQ4' ? NATIVE_KERNEL_DOMAIN : MS_DOMAIN)
    const r = g.op('ReduceSum', `r${i}`, [y, g.i64([1])], { keepdims: 1 })
    sum = sum === undefined ? r : g.op('Add', `a${i}`, [sum, r])
  })
  g.output('y', sum!, DT.FLOAT, ['M', 1])
  writeFileSync(join(dir, `${op}.onnx`), g.encode(op, op))
  writeFileSync(join(dir, `${op}.onnx.data`), Buffer.concat(g.data()))
  return join(dir, `${op}.onnx`)
}

const lib = await buildNativeKernels()
process.dlopen({ exports: {} }, lib)
const dir = mkdtempSync(join(tmpdir(), 'shoal-int4-kernel-'))
try {
  const options = sessionOptions({ threads: Number(args.threads) })
  const sides = {
    MatMulNBits: await ort.InferenceSession.create(graph(dir, 'MatMulNBits'), options),
    MatMulQ4: await ort.InferenceSession.create(graph(dir, 'MatMulQ4'), options),
  }
  const feeds = (M: number): Record<string, ort.Tensor> => ({ x: new ort.Tensor('float32', uniform(M * D), [M, D]), h: new ort.Tensor('float32', uniform(M * F), [M, F]) })

  // Agreement at eight rows, on the reduced sums (each carries every output's rounding of its row).
  const f8 = feeds(8)
  const [a, b] = [await sides.MatMulNBits.run(f8), await sides.MatMulQ4.run(f8)]
  const ya = a.y!.data as Float32Array
  const yb = b.y!.data as Float32Array
  let top = 0
  let diff = 0
  for (let i = 0; i < ya.length; i++) { top = Math.max(top, Math.abs(ya[i]!)); diff = Math.max(diff, Math.abs(ya[i]! - yb[i]!)) }

  const loadBefore = loadAverage()
  const times: Record<string, number[]> = {}
  const runs = Number(args.runs)
  for (let round = 0; round < Number(args.rounds); round++) {
    for (const M of rowsList) {
      const f = feeds(M)
      // Alternate which side goes first, round by round.
      const order = round % 2 === 0 ? (['MatMulNBits', 'MatMulQ4'] as const) : (['MatMulQ4', 'MatMulNBits'] as const)
      for (const side of order) {
        const s = sides[side]
        const n = M >= 32 ? Math.max(4, runs >> 3) : runs
        for (let r = 0; r < Math.max(2, n >> 3); r++) await s.run(f)
        for (let r = 0; r < n; r++) {
          const t = performance.now()
          await s.run(f)
          ;(times[`${side} ${M}`] ??= []).push(performance.now() - t)
        }
      }
    }
  }
  console.log(`# int4 products of the ${args.size} shape (${products.length}${args['no-head'] ? ', no head' : ''}), MatMulNBits against MatMulQ4`)
  console.log(`- command: node reproduction/bench-int4-kernel.ts ${process.argv.slice(2).join(' ')}`)
  console.log(`- machine: ${lscpuModel()}; Node ${process.version}; malloc: ${mallocSettings()}; git ${gitDescribe(join(import.meta.dirname, '..'))}; load ${loadBefore} → ${loadAverage()}`)
  console.log(`- reduced sums at M = 8: max |MatMulNBits − MatMulQ4| / max |MatMulNBits| = ${(diff / top).toExponential(2)}`)
  console.log('\n| rows | MatMulNBits ms | MatMulQ4 ms | MatMulNBits ÷ MatMulQ4 |')
  console.log('|---:|---:|---:|---:|')
  for (const M of rowsList) {
    const x = median(times[`MatMulNBits ${M}`]!)
    const y = median(times[`MatMulQ4 ${M}`]!)
    console.log(`| ${M} | ${x.toFixed(3)} | ${y.toFixed(3)} | **${(x / y).toFixed(2)}** |`)
  }
} finally {
  rmSync(dir, { recursive: true, force: true })
}
