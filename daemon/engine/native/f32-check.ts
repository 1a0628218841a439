/**
 * Whether MatMulF32 (ort-kernels.c, f32-matmul.h) gives onnxruntime's MatMul's bits on this
 * machine: its sums are MLAS's packed SGEMM's order (blocks of 256 k, each one fused multiply-add
 * chain from zero, added in order), read off MLAS, not promised by it. So before a loader swaps a
 * graph's f32 products (swap.ts swapF32Products), one graph asks: MatMul beside MatMulF32 on the
 * same weights, at one, two, eight, nine and sixteen rows (the kernel's few-row and blocked paths),
 * K past one block of 256 and N not a multiple of 16 (a partial last block), every output compared
 * bit for bit. Where they differ the products stay onnxruntime's. Run on a session worker
 * (off-thread-sessions.ts), never on the caller's event loop; memoized per thread and library.
 */
import * as ort from 'onnxruntime-node'
import { NATIVE_KERNEL_DOMAIN } from '../../../shards/contract.ts'
import { DT } from '../../../shards/graph/builder.ts'
import { askKernelGraph, checkRandom, sameBits } from './bit-check.ts'

/** The shapes asked: [K, N]. 300: a whole block of 256 and a partial one; 40: two tiles past a block of 16. */
const SHAPES: ReadonlyArray<readonly [number, number]> = [[300, 40], [64, 24]]
const ROWS: readonly number[] = [1, 2, 8, 9, 16]

/** Whether the library's MatMulF32 gives MatMul's outputs bit for bit here. */
export async function f32ProductsExact (lib: string): Promise<boolean> {
  const rand = checkRandom(4242)
  return await askKernelGraph('f32-check', lib, g => {
    SHAPES.forEach(([K, N], i) => {
      const x = g.input(`x${i}`, DT.FLOAT, ['m', K])
      const w = g.f32Weight(`w${i}`, [K, N], Float32Array.from({ length: K * N }, () => rand() * 0.2))
      g.output(`kernel${i}`, g.op('MatMulF32', `/kernel${i}`, [x, w], {}, NATIVE_KERNEL_DOMAIN), DT.FLOAT, ['m', N])
      g.output(`mlas${i}`, g.op('MatMul', `/mlas${i}`, [x, w]), DT.FLOAT, ['m', N])
    })
  }, async session => {
    for (const M of ROWS) {
      const feeds: Record<string, ort.Tensor> = {}
      SHAPES.forEach(([K], i) => { feeds[`x${i}`] = new ort.Tensor('float32', Float32Array.from({ length: M * K }, () => rand() * 4), [M, K]) })
      const out = await session.run(feeds)
      if (!SHAPES.every((_, i) => sameBits(out[`kernel${i}`]!.data as Float32Array, out[`mlas${i}`]!.data as Float32Array))) return false
    }
    return true
  })
}
