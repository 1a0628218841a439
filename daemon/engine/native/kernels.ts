/**
 * shoal's int4 kernel in a node: built, loaded into this process, checked, or off with the reason.
 *
 * Why a kernel of shoal's own: with eight streams, MLAS's int4 product (MatMulNBits) bounds the
 * step; MatMulQ4 (q4-matmul.h) does the same arithmetic 1.4–2× faster at eight rows (AVX2 to
 * AVX-512 VNNI; at one row 1.0–1.6×) and gives a row
 * the same bits whatever its batch, its threads or its CPU's vector width (docs/engine-notes.md,
 * waves 35–36). onnxruntime-node cannot register a custom op, so the library stands in for
 * onnxruntime's API entry and adds its op domain to every session made after it is loaded
 * (ort-kernels.c); a graph then runs the kernel where swap.ts made its products MatMulQ4.
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
import { DT, GraphBuilder, MS_DOMAIN } from '../../../shards/graph/builder.ts'
import { quantizeMatrix } from '../../../shards/quant.ts'
import { createOffThreadSessions } from '../off-thread-sessions.ts'
import { buildKernelLibrary, hasCompiler } from './build.ts'
import { loadKernelLibrary } from './load.ts'

/** The outcome: the library's path, loaded into this process, or why not. */
export type NativeKernels = { lib: string } | { off: string }

/**
 * The self-check's tolerance: the kernel and MatMulNBits quantise the activations alike and sum in
 * other orders, so they differ by float rounding (~1e-6 of the output's scale); a wrong kernel
 * (an ABI it does not match, a miscompiled path) is off by the output's own size.
 */
const CHECK_TOLERANCE = 1e-4

/**
 * One product on random weights run by the kernel and by MatMulNBits, in one session on a session
 * worker; their largest difference relative to the largest output. Rows 1 and 9: the kernel's
 * one-row and multi-row paths.
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
    await writeFile(join(dir, 'check.onnx'), g.encode('check', 'shoal kernels self-check'))
    await writeFile(join(dir, 'check.onnx.data'), Buffer.concat(g.data()))
    const session = await host.create(join(dir, 'check.onnx'), { threads: 1 })
    let worst = 0
    for (const M of [1, 9]) {
      const out = await session.run({ x: new ort.Tensor('float32', Float32Array.from({ length: M * K }, () => 4 * rand()), [M, K]) })
      const a = out.kernel!.data as Float32Array
      const b = out.reference!.data as Float32Array
      let scale = 0
      let diff = 0
      for (let i = 0; i < b.length; i++) {
        scale = Math.max(scale, Math.abs(b[i]!))
        diff = Math.max(diff, Math.abs(a[i]! - b[i]!))
      }
      worst = Math.max(worst, Number.isFinite(diff) ? diff / Math.max(scale, 1e-30) : Number.POSITIVE_INFINITY)
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
    if (!(diff <= CHECK_TOLERANCE)) return { off: `its self-check differs from onnxruntime's MatMulNBits by ${diff.toExponential(2)} of the output (tolerance ${CHECK_TOLERANCE})` }
  } catch (err) {
    return { off: `its self-check failed: ${(err as Error).message}` }
  }
  return { lib }
}
