/**
 * Whether GreedyHead (ort-kernels.c, greedy-head.h) gives onnxruntime's own bits on this machine:
 * its exact sums are MLAS's packed SGEMM's order (blocks of 256 columns, each one fused
 * multiply-add chain), read off MLAS, not promised by it. So before a loader swaps a head
 * (swap.ts swapHead), one graph asks: a Gemm (transB) and its TopK beside GreedyHead with
 * `exact_logits`, on two head shapes (a whole block and a remainder; a vocabulary that is not a
 * multiple of 16), every logit compared bit for bit and every token. Where they differ the head
 * stays onnxruntime's and the other kernels serve as before. Run on a session worker
 * (off-thread-sessions.ts), never on the caller's event loop; memoized per thread and library (an
 * engine worker asks once before its first session, the daemon once for its 'model loaded' line).
 */
import * as ort from 'onnxruntime-node'
import { NATIVE_KERNEL_DOMAIN } from '../../../shards/contract.ts'
import { DT } from '../../../shards/graph/builder.ts'
import { askKernelGraph, checkRandom, sameBits } from './bit-check.ts'

/** The shapes asked: [vocabulary rows, columns]. 1,000 columns: three whole blocks and a partial one. */
const SHAPES: ReadonlyArray<readonly [number, number]> = [[300, 1000], [70, 200]]
// Rows enough that a screen summing wrong (its candidates then the wrong rows) gives a wrong token somewhere.
const ROWS = 16

/** Whether the library's GreedyHead gives the Gemm's logits and TopK's tokens bit for bit here. */
export async function greedyHeadExact (lib: string): Promise<boolean> {
  const rand = checkRandom(12345)
  return await askKernelGraph('head-check', lib, g => {
    SHAPES.forEach(([V, K], i) => {
      const x = g.input(`x${i}`, DT.FLOAT, [ROWS, 1, K])
      const w = g.f32Weight(`w${i}`, [V, K], Float32Array.from({ length: V * K }, () => rand() * 0.1))
      const logits = g.op('Gemm', `/gemm${i}`, [g.op('Reshape', `/flat${i}`, [x, g.i64([-1, K])]), w], { transB: 1 })
      const top = g.node('TopK', `/topk${i}`, [logits, g.i64([1])], { axis: -1, largest: 1, sorted: 1 }, 2)[1]!
      const [exact, token] = g.node('GreedyHead', `/head${i}`, [x, w], { exact_logits: 1 }, 2, NATIVE_KERNEL_DOMAIN)
      // Outputs last: naming an output renames its producer's value.
      g.output(`logits${i}`, logits, DT.FLOAT, [ROWS, V])
      g.output(`token${i}`, top, DT.INT64, [ROWS, 1])
      g.output(`exact${i}`, exact!, DT.FLOAT, [ROWS, 1, V])
      g.output(`greedy${i}`, token!, DT.INT64, [ROWS, 1, 1])
    })
  }, async session => {
    const feeds: Record<string, ort.Tensor> = {}
    SHAPES.forEach(([, K], i) => { feeds[`x${i}`] = new ort.Tensor('float32', Float32Array.from({ length: ROWS * K }, (_, j) => rand() * (j < K ? 8 : 2)), [ROWS, 1, K]) })
    const out = await session.run(feeds)
    return SHAPES.every((_, i) => sameBits(out[`logits${i}`]!.data as Float32Array, out[`exact${i}`]!.data as Float32Array) &&
      (out[`token${i}`]!.data as BigInt64Array).every((t, r) => t === (out[`greedy${i}`]!.data as BigInt64Array)[r]))
  })
}
