/**
 * How close onnxruntime's f32 products come to this machine's ceilings (issue 11;
 * docs/engine-notes.md, wave 43): the fused multiply-add peak and the memory bandwidth, measured by
 * reproduction/native/ceilings.c on 1..N threads, beside the time MLAS takes for every layer's
 * products of a model's shape (the shard's manifest: q/k/v, o, gate/up, down of each layer, f32
 * weights as the shards hold them, prepacked as served; the head is GreedyHead's or the Gemm's and
 * is left out) at M rows: one decode row, a batch of decode rows, a prompt's chunk. Each M's floor
 * is the larger of the weights' bytes over the stream bandwidth and its FLOPs over the FMA peak (a
 * kernel that overlapped the two perfectly would run at it); `÷ floor` says how far MLAS is above.
 *
 *   node reproduction/roofline.ts --shard DIR [--rows 1,8,128] [--reps 9] [--threads N]
 *
 * Run it as the other benchmarks (`chrt -r 10 node …`, nothing else on the machine). Rows alternate
 * within every rep so that the VM's slow minutes fall on all of them; the medians are printed, and
 * the ceilings are measured before and after the products (a VM's second core is sometimes half
 * a core: both are printed). Weights are random (the same shapes as the shard's, not its bytes):
 * the products' time does not depend on the values.
 */
import { execFile } from 'node:child_process'
import { availableParallelism, tmpdir } from 'node:os'
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs, promisify } from 'node:util'
import onnxProto from 'onnx-proto'
import ort from 'onnxruntime-node'
import { sessionOptions } from '../daemon/engine/backend/onnxruntime.ts'
import { buildC, f32KernelFits } from '../daemon/engine/native/build.ts'
import { loadKernelLibrary } from '../daemon/engine/native/load.ts'
import { NATIVE_KERNEL_DOMAIN } from '../shards/contract.ts'
import { DT, GraphBuilder } from '../shards/graph/builder.ts'
import { loadManifest } from '../shards/index.ts'
import { gitDescribe, loadAverage, lscpuModel, median } from './lib/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'
import { nodeKernels } from './lib/native-kernels.ts'

// The sessions run in this process: with `shoal serve`'s malloc settings, as served.
execWithServeMalloc()

const run = promisify(execFile)
const ROOT = resolve(import.meta.dirname, '..')

const { values: args } = parseArgs({
  options: { shard: { type: 'string' }, rows: { type: 'string', default: '1,8,128' }, reps: { type: 'string', default: '9' }, threads: { type: 'string' } },
})
if (args.shard === undefined) throw new Error('usage: node reproduction/roofline.ts --shard DIR [--rows 1,8,128] [--reps 9] [--threads N]')
const ROWS = args.rows.split(',').map(Number)
const REPS = Number(args.reps)
const THREADS = args.threads === undefined ? availableParallelism() : Number(args.threads)
if (ROWS.some(m => !(Number.isInteger(m) && m >= 1)) || !(REPS >= 1) || !(THREADS >= 1)) throw new Error('--rows, --reps and --threads take positive integers')

const { modelId, shape, quantization } = await loadManifest(args.shard)
if (quantization.kind !== 'none') throw new Error(`${modelId}: an f32 shard is needed (this measures MLAS's f32 products)`)
const { hiddenSize: D, numHeads: H, numKvHeads: kvH, headDim: hd, intermediateSize: I, numLayers: L } = shape
/** Each layer's products as [K, N]: the fused q/k/v, o, the fused gate/up, down (shards/graph/blocks.ts). */
const products: Array<[number, number]> = [[D, (H + 2 * kvH) * hd], [H * hd, D], [D, 2 * I], [I, D]]
const params = L * products.reduce((a, [k, n]) => a + k * n, 0)

/** The ceilings on 1..THREADS threads: FMA GFLOP/s and stream GB/s, by thread count. */
async function ceilings (): Promise<{ fma: Map<number, number>, stream: Map<number, number> }> {
  const bin = await buildC({ source: join(ROOT, 'reproduction', 'native', 'ceilings.c'), name: 'ceilings', flags: ['-O3', '-march=native'], libs: ['-lpthread'] }, join(ROOT, '.cache', 'native-kernels'))
  // Four times the largest L3 this project has met (32 MiB): no pass is served from a cache.
  const { stdout } = await run(bin, [String(THREADS), '512', '5'], { timeout: 300_000 })
  const fma = new Map<number, number>()
  const stream = new Map<number, number>()
  for (const line of stdout.trim().split('\n')) {
    const [what, threads, value] = line.split(' ')
    ;(what === 'fma' ? fma : stream).set(Number(threads), Number(value))
  }
  return { fma, stream }
}

/**
 * A graph of the layers' products chained as the model chains them (q/k/v's first H·hd columns
 * feed o, gate/up's first I columns feed down: two Slices a layer, the rest of each output
 * unread), x [M, D] in and out, its weights in an external file as shards keep them; with
 * `kernel`, the same graph on MatMulF32 beside it (derived at encoding: the same weights and data
 * file, drawn once). The graphs' paths by arm.
 */
async function productGraphs (dir: string, kernel: boolean): Promise<Map<string, string>> {
  const g = new GraphBuilder('products.onnx.data')
  let seed = 1
  const rand = (): number => { seed = (Math.imul(seed, 1103515245) + 12345) >>> 0; return ((seed >>> 8) / 16777216 - 0.5) * 0.1 }
  let x = g.input('x', DT.FLOAT, ['M', D])
  for (let l = 0; l < L; l++) {
    const w = (name: string, [k, n]: [number, number]): string => g.f32Weight(`l${l}.${name}`, [k, n], Float32Array.from({ length: k * n }, rand))
    const qkv = g.op('MatMul', `/l${l}/qkv`, [x, w('qkv', products[0]!)])
    const ctx = g.op('Slice', `/l${l}/ctx`, [qkv, g.i64([0]), g.i64([H * hd]), g.i64([1])])
    const o = g.op('MatMul', `/l${l}/o`, [ctx, w('o', products[1]!)])
    const gu = g.op('MatMul', `/l${l}/gate_up`, [o, w('gate_up', products[2]!)])
    const h = g.op('Slice', `/l${l}/h`, [gu, g.i64([0]), g.i64([I]), g.i64([1])])
    x = g.op('MatMul', `/l${l}/down`, [h, w('down', products[3]!)])
  }
  g.output('y', x, DT.FLOAT, ['M', D])
  const paths = new Map([['MLAS', join(dir, 'products.onnx')]])
  await writeFile(paths.get('MLAS')!, g.encode('roofline', 'the layers\' products of one shape'))
  await writeFile(join(dir, 'products.onnx.data'), Buffer.concat(g.data()))
  if (kernel) {
    paths.set('MatMulF32', join(dir, 'products-kernel.onnx'))
    g.otherDomains.add(NATIVE_KERNEL_DOMAIN)
    const onKernel = (graph: onnxProto.onnx.IGraphProto): onnxProto.onnx.IGraphProto =>
      ({ ...graph, node: (graph.node ?? []).map(n => n.opType === 'MatMul' ? { ...n, opType: 'MatMulF32', domain: NATIVE_KERNEL_DOMAIN } : n) })
    await writeFile(paths.get('MatMulF32')!, g.encode('roofline', 'the layers\' products of one shape, on MatMulF32', onKernel))
  }
  return paths
}

const loadBefore = loadAverage()
// shoal's MatMulF32 beside MLAS where its library builds here and the CPU is one it runs on (f32KernelFits).
const lib = await nodeKernels({ quantization: { kind: 'none' }, opSet: 'ort-contrib', decodeAttention: 'grouped', shape })
const arms = ['MLAS', ...lib.kernels !== undefined && await f32KernelFits() ? ['MatMulF32'] : []]
if (lib.kernels !== undefined) loadKernelLibrary(lib.kernels)
const before = await ceilings()
const dir = await mkdtemp(join(tmpdir(), 'shoal-roofline-'))
const times = new Map<string, number[]>(arms.flatMap(a => ROWS.map(m => [`${a} ${m}`, []])))
try {
  const sessions = new Map<string, ort.InferenceSession>()
  const graphs = await productGraphs(dir, arms.length > 1)
  for (const arm of arms) sessions.set(arm, await ort.InferenceSession.create(graphs.get(arm)!, sessionOptions({ threads: THREADS })))
  const feeds = new Map(ROWS.map(m => [m, { x: new ort.Tensor('float32', new Float32Array(m * D).fill(0.01), [m, D]) }]))
  // Two untimed runs of each: MLAS's prepacking, the kernel's repacking, the first pages.
  for (const [, session] of sessions) for (const m of ROWS) for (let i = 0; i < 2; i++) await session.run(feeds.get(m)!)
  const order = arms.flatMap(a => ROWS.map(m => [a, m] as const))
  for (let r = 0; r < REPS; r++) {
    for (const [arm, m] of r % 2 === 0 ? order : [...order].reverse()) {
      const t = performance.now()
      await sessions.get(arm)!.run(feeds.get(m)!)
      times.get(`${arm} ${m}`)!.push(performance.now() - t)
    }
  }
  for (const [, session] of sessions) await session.release()
} finally {
  await rm(dir, { recursive: true, force: true })
}
const after = await ceilings()

const peak = (c: Map<number, number>[], t: number): number => Math.max(...c.map(m => m.get(t) ?? NaN))
const fma = peak([before.fma, after.fma], THREADS)
const stream = peak([before.stream, after.stream], THREADS)
console.log(`# ${modelId}: every layer's f32 products (${L} layers, ${(params / 1e6).toFixed(1)} M weights, ${(params * 4 / 1e6).toFixed(0)} MB) against this machine's ceilings`)
console.log(`- command: node reproduction/roofline.ts ${process.argv.slice(2).join(' ')}`)
console.log(`- machine: ${lscpuModel()}, ${availableParallelism()} CPUs; Node ${process.version}; onnxruntime-node ${ort.env.versions.common}; git ${gitDescribe(ROOT)}; load ${loadBefore} → ${loadAverage()}`)
for (const [name, c] of [['before', before], ['after', after]] as const) {
  const per = [...c.stream.keys()].map(t => `${t} thread${t === 1 ? '' : 's'}: FMA ${c.fma.get(t)?.toFixed(0) ?? '—'} GFLOP/s, stream ${c.stream.get(t)!.toFixed(1)} GB/s`)
  console.log(`- ceilings ${name} the products: ${per.join('; ')}`)
}
console.log(`- floor at ${THREADS} thread${THREADS === 1 ? '' : 's'}: max(bytes ÷ ${stream.toFixed(1)} GB/s, FLOPs ÷ ${Number.isFinite(fma) ? fma.toFixed(0) : '—'} GFLOP/s), the better of the two ceiling runs; ${arms.join(' and ')} with ${THREADS} intra-op thread${THREADS === 1 ? '' : 's'} as served (one session each, arms and rows alternating), medians of ${REPS}\n`)
console.log('| rows | product | ms | GFLOP/s | weights GB/s | stream floor ms | FMA floor ms | ÷ floor |')
console.log('|---:|---|---:|---:|---:|---:|---:|---:|')
for (const m of ROWS) {
  for (const arm of arms) {
    const ms = median(times.get(`${arm} ${m}`)!)
    const flops = 2 * m * params
    const streamMs = params * 4 / stream / 1e6
    const fmaMs = flops / fma / 1e6
    const floor = Math.max(streamMs, Number.isFinite(fmaMs) ? fmaMs : 0)
    console.log(`| ${m} | ${arm} | ${ms.toFixed(2)} | ${(flops / ms / 1e6).toFixed(0)} | ${(params * 4 / ms / 1e6).toFixed(1)} | ${streamMs.toFixed(2)} | ${Number.isFinite(fmaMs) ? fmaMs.toFixed(2) : '—'} | **${(ms / floor).toFixed(2)}** |`)
  }
}
