/**
 * shoal's kernels in a node: built, loaded into this process, checked, or off with the reason.
 *
 * Why a kernel of shoal's own: with eight streams, MLAS's int4 product (MatMulNBits) bounds the
 * step; MatMulQ4 (q4-matmul.h) does the same arithmetic 1.4–2× faster at eight rows (AVX2 to
 * AVX-512 VNNI; at one row 1.0–1.6×) and gives a row
 * the same bits whatever its batch, its threads or its CPU's vector width (docs/engine-notes.md,
 * waves 35–36). onnxruntime-node cannot register a custom op, so the library stands in for
 * onnxruntime's API entry and adds its op domain to every session made after it is loaded
 * (ort-kernels.c); a graph then runs the kernel where swap.ts made its products MatMulQ4. The
 * same library carries a fused one-position attention (DecodeAttention), which swap.ts puts in
 * place of the compiler's attention nodes: on the Zen 5 of waves 34–35 +15–27 % a decoded token,
 * on wave 36's AVX2 EPYC +5–10 %.
 *
 * The library is C, built here by `cc` for this CPU (build.ts): a node without a compiler, off
 * x86-64 Linux (the kernel's vector paths are x86's, and untimed elsewhere), or whose build fails
 * its self-check serves on onnxruntime's own kernel, as before, and says why.
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import * as ort from 'onnxruntime-node'
import { NATIVE_KERNEL_DOMAIN } from '../../../shards/contract.ts'
import { decodeAttentionNodes } from '../../../shards/graph/attention.ts'
import { DT, GraphBuilder, MS_DOMAIN } from '../../../shards/graph/builder.ts'
import { quantizeMatrix } from '../../../shards/quant.ts'
import { createOffThreadSessions } from '../off-thread-sessions.ts'
import { buildKernelLibrary, hasCompiler } from './build.ts'
import { loadKernelLibrary } from './load.ts'

/** The outcome: the library's path, loaded into this process, or why not. */
export type NativeKernels = { lib: string } | { off: string }

/**
 * What a `model loaded` line says runs an int4 model's products (`int4Kernel`): shoal's kernel
 * where it does, else onnxruntime's, with why shoal's is off where it was prepared and is
 * (engines and expert-parallel stages and holders alike).
 */
export function int4KernelName (onShoal: boolean, kernels?: NativeKernels): string {
  if (onShoal) return 'shoal'
  return kernels !== undefined && 'off' in kernels ? `onnxruntime (shoal's: ${kernels.off})` : 'onnxruntime'
}

/**
 * The self-check's tolerance: the kernel and MatMulNBits quantise the activations alike and sum in
 * other orders, so they differ by float rounding (~1e-6 of the output's scale); a wrong kernel
 * (an ABI it does not match, a miscompiled path) is off by the output's own size.
 */
const CHECK_TOLERANCE = 1e-4

/** Largest |a − b| over the largest |b| (∞ where a is not finite). */
function relativeDiff (a: Float32Array, b: Float32Array): number {
  let scale = 0
  let diff = 0
  for (let i = 0; i < b.length; i++) {
    scale = Math.max(scale, Math.abs(b[i]!))
    diff = Math.max(diff, Math.abs(a[i]! - b[i]!))
  }
  return Number.isFinite(diff) ? diff / Math.max(scale, 1e-30) : Number.POSITIVE_INFINITY
}

/**
 * The kernels against onnxruntime's own ops on random inputs, in one session on a session worker:
 * one int4 product by the kernel and by MatMulNBits, twice (scales that are IEEE halves, as the
 * compiler writes them since version 14 and the kernel then packs, and scales that are not, as
 * older shards' are), one f32 product by MatMulF32 and by MatMul
 * (rows 1 and 9: each kernel's few-row and many-row paths), one layer's one-position attention by DecodeAttention and by the
 * compiler's grouped form (three rows of 20, 32 and 5 live columns in a buffer of 32), and a
 * verify step of three positions by VerifyAttention and by GroupQueryAttention (one row, live
 * pasts of 20 and 29 in a buffer of 32). Their largest difference relative to the largest output.
 */
async function selfCheck (): Promise<number> {
  const K = 96
  const N = 40
  let s = 7
  const rand = (): number => { s = (s * 1103515245 + 12345) % 2147483648; return s / 2147483648 - 0.5 }
  const dir = await mkdtemp(join(tmpdir(), 'shoal-kernels-check-'))
  const host = createOffThreadSessions()
  try {
    const g = new GraphBuilder('check.onnx.data')
    const x = g.input('x', DT.FLOAT, ['m', K])
    const q = quantizeMatrix(Float32Array.from({ length: N * K }, rand), N, K, 4, 32)
    const w = g.weight('w.q', DT.UINT8, [N, K / 32, 16], q.data)
    const sc = g.weight('w.s', DT.FLOAT, [N * K / 32], new Uint8Array(q.scales.buffer))
    const attrs = { K, N, bits: 4, block_size: 32, accuracy_level: 4 }
    g.output('kernel', g.op('MatMulQ4', '/kernel', [x, w, sc], attrs, NATIVE_KERNEL_DOMAIN), DT.FLOAT, ['m', N])
    g.output('reference', g.op('MatMulNBits', '/reference', [x, w, sc], attrs, MS_DOMAIN), DT.FLOAT, ['m', N])
    // The same weights with scales no half equals (each a few float steps off one).
    const scf = g.weight('w.s32', DT.FLOAT, [N * K / 32], new Uint8Array(q.scales.map(v => Math.fround(v * (1 + 2 ** -20))).buffer))
    g.output('kernel.f32scales', g.op('MatMulQ4', '/kernel/f32scales', [x, w, scf], attrs, NATIVE_KERNEL_DOMAIN), DT.FLOAT, ['m', N])
    g.output('reference.f32scales', g.op('MatMulNBits', '/reference/f32scales', [x, w, scf], attrs, MS_DOMAIN), DT.FLOAT, ['m', N])
    // N = 40: five tiles of 8, so the many-row path's last block is one tile, past a whole block.
    const wf = g.f32Weight('w.f32', [K, N], Float32Array.from({ length: K * N }, rand))
    g.output('f32.kernel', g.op('MatMulF32', '/f32/kernel', [x, wf], {}, NATIVE_KERNEL_DOMAIN), DT.FLOAT, ['m', N])
    g.output('f32.reference', g.op('MatMul', '/f32/reference', [x, wf]), DT.FLOAT, ['m', N])
    const shape = { numHeads: 8, numKvHeads: 2, headDim: 64 }
    const kvWidth = shape.numKvHeads * shape.headDim
    const parts = { q: g.input('q', DT.FLOAT, ['b', 1, shape.numHeads * shape.headDim]), k: g.input('k', DT.FLOAT, ['b', 1, kvWidth]), v: g.input('v', DT.FLOAT, ['b', 1, kvWidth]) }
    const past = [g.input('past_key', DT.FLOAT, ['b', shape.numKvHeads, 'w', shape.headDim]), g.input('past_value', DT.FLOAT, ['b', shape.numKvHeads, 'w', shape.headDim])] as const
    const tables = { bias: g.input('bias', DT.FLOAT, ['b', 1, 1, 'w']), ones: g.input('ones', DT.FLOAT, ['w', 1]), seqlensK: g.input('seqlens_k', DT.INT32, ['b']) }
    for (const form of ['native', 'grouped'] as const) {
      const [context] = decodeAttentionNodes(g, shape, form, `/${form}`, parts, past[0], past[1], tables)
      g.output(`attention.${form}`, context!, DT.FLOAT, ['b', 1, shape.numHeads * shape.headDim])
    }
    const heads = { num_heads: shape.numHeads, kv_num_heads: shape.numKvHeads }
    // One row: GroupQueryAttention takes a step of several positions over a past for one row only.
    const step = [
      g.input('vq', DT.FLOAT, [1, 's', shape.numHeads * shape.headDim]), g.input('vk', DT.FLOAT, [1, 's', kvWidth]), g.input('vv', DT.FLOAT, [1, 's', kvWidth]),
      g.input('vpk', DT.FLOAT, [1, shape.numKvHeads, 'w', shape.headDim]), g.input('vpv', DT.FLOAT, [1, shape.numKvHeads, 'w', shape.headDim]), g.input('vseq', DT.INT32, [1]),
    ]
    g.output('verify.kernel', g.op('VerifyAttention', '/verify', step, heads, NATIVE_KERNEL_DOMAIN), DT.FLOAT, [1, 's', shape.numHeads * shape.headDim])
    const [gqa] = g.node('GroupQueryAttention', '/gqa', [...step, g.input('vtotal', DT.INT32, [1])], { ...heads, scale: { float: 1 / Math.sqrt(shape.headDim) } }, 3, MS_DOMAIN)
    g.output('verify.reference', gqa!, DT.FLOAT, [1, 's', shape.numHeads * shape.headDim])
    await writeFile(join(dir, 'check.onnx'), g.encode('check', 'shoal kernels self-check'))
    await writeFile(join(dir, 'check.onnx.data'), Buffer.concat(g.data()))
    const session = await host.create(join(dir, 'check.onnx'), { threads: 1 })
    const f32 = (dims: number[], of: (i: number) => number = () => rand()): ort.Tensor =>
      new ort.Tensor('float32', Float32Array.from({ length: dims.reduce((a, d) => a * d, 1) }, (_, i) => of(i)), dims)
    const lengths = [20, 32, 5]
    const [B, W] = [lengths.length, 32]
    const attention = {
      q: f32([B, 1, shape.numHeads * shape.headDim]), k: f32([B, 1, kvWidth]), v: f32([B, 1, kvWidth]),
      past_key: f32([B, shape.numKvHeads, W, shape.headDim]), past_value: f32([B, shape.numKvHeads, W, shape.headDim]),
      bias: f32([B, 1, 1, W], i => i % W < lengths[Math.floor(i / W)]! ? 0 : Number.NEGATIVE_INFINITY), ones: f32([W, 1], () => 1),
      seqlens_k: new ort.Tensor('int32', Int32Array.from(lengths), [B]),
    }
    // A verify step of S positions after a live past of `live` columns (seqlens_k: past + S − 1).
    const S = 3
    const verify = (live: number): Record<string, ort.Tensor> => ({
      vq: f32([1, S, shape.numHeads * shape.headDim]), vk: f32([1, S, kvWidth]), vv: f32([1, S, kvWidth]),
      vpk: f32([1, shape.numKvHeads, W, shape.headDim]), vpv: f32([1, shape.numKvHeads, W, shape.headDim]),
      vseq: new ort.Tensor('int32', Int32Array.of(live + S - 1), [1]), vtotal: new ort.Tensor('int32', Int32Array.of(live + S), [1]),
    })
    let worst = 0
    for (const M of [1, 9]) {
      const out = await session.run({ x: f32([M, K], () => 4 * rand()), ...attention, ...verify(M === 1 ? 20 : 29) })
      worst = Math.max(worst, relativeDiff(out.kernel!.data as Float32Array, out.reference!.data as Float32Array),
        relativeDiff(out['kernel.f32scales']!.data as Float32Array, out['reference.f32scales']!.data as Float32Array),
        relativeDiff(out['f32.kernel']!.data as Float32Array, out['f32.reference']!.data as Float32Array),
        relativeDiff(out['attention.native']!.data as Float32Array, out['attention.grouped']!.data as Float32Array),
        relativeDiff(out['verify.kernel']!.data as Float32Array, out['verify.reference']!.data as Float32Array))
    }
    return worst
  } finally {
    await host.close()
    await rm(dir, { recursive: true, force: true })
  }
}

let prepared: Promise<NativeKernels> | undefined

/**
 * The kernel for this process, under `cacheDir` (built there once per source and CPU): loaded and
 * checked once a process, whatever the cache (a process holds one copy of the library). Never
 * rejects: a failure is the reason the node serves without it.
 */
export async function prepareNativeKernels (cacheDir: string): Promise<NativeKernels> {
  prepared ??= prepare(cacheDir)
  return await prepared
}

async function prepare (cacheDir: string): Promise<NativeKernels> {
  if (process.platform !== 'linux' || process.arch !== 'x64') return { off: `built and timed on x86-64 Linux only (this is ${process.platform}-${process.arch})` }
  if (!await hasCompiler()) return { off: 'no C compiler (`cc`) to build it' }
  let lib: string
  try {
    lib = await buildKernelLibrary(cacheDir)
    loadKernelLibrary(lib)
  } catch (err) {
    return { off: (err as Error).message }
  }
  try {
    const diff = await selfCheck()
    if (!(diff <= CHECK_TOLERANCE)) return { off: `its self-check differs from onnxruntime's own ops by ${diff.toExponential(2)} of the output (tolerance ${CHECK_TOLERANCE})` }
  } catch (err) {
    return { off: `its self-check failed: ${(err as Error).message}` }
  }
  return { lib }
}
