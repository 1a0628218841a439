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
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import * as ort from 'onnxruntime-node'
import { createOffThreadSessions } from '../off-thread-sessions.ts'
import { NATIVE_KERNEL_DOMAIN } from '../../../shards/contract.ts'
import { DT, GraphBuilder } from '../../../shards/graph/builder.ts'
import { sameBits } from './head-check.ts'
import { loadKernelLibrary } from './load.ts'

/** The shapes asked: [K, N]. 300: a whole block of 256 and a partial one; 40: two tiles past a block of 16. */
const SHAPES: ReadonlyArray<readonly [number, number]> = [[300, 40], [64, 24]]
const ROWS: readonly number[] = [1, 2, 8, 9, 16]

const memo = new Map<string, Promise<boolean>>()

/** Whether the library's MatMulF32 gives MatMul's outputs bit for bit here. */
export async function f32ProductsExact (lib: string): Promise<boolean> {
  let p = memo.get(lib)
  if (p === undefined) memo.set(lib, p = ask(lib).catch(() => false))
  return await p
}

async function ask (lib: string): Promise<boolean> {
  loadKernelLibrary(lib)
  // A fixed pseudo-random sequence (Math.imul: a double product would lose the low bits).
  let s = 4242
  const rand = (): number => { s = (Math.imul(s, 1103515245) + 12345) >>> 0; return (s >>> 8) / 16777216 - 0.5 }
  const dir = await mkdtemp(join(tmpdir(), 'shoal-f32-check-'))
  const host = createOffThreadSessions()
  try {
    const g = new GraphBuilder('check.onnx.data')
    SHAPES.forEach(([K, N], i) => {
      const x = g.input(`x${i}`, DT.FLOAT, ['m', K])
      const w = g.f32Weight(`w${i}`, [K, N], Float32Array.from({ length: K * N }, () => rand() * 0.2))
      g.output(`kernel${i}`, g.op('MatMulF32', `/kernel${i}`, [x, w], {}, NATIVE_KERNEL_DOMAIN), DT.FLOAT, ['m', N])
      g.output(`mlas${i}`, g.op('MatMul', `/mlas${i}`, [x, w]), DT.FLOAT, ['m', N])
    })
    await writeFile(join(dir, 'check.onnx'), g.encode('f32-check', 'shoal MatMulF32 self-check'))
    await writeFile(join(dir, 'check.onnx.data'), Buffer.concat(g.data()))
    // Two threads, as engines run: the products' columns shared between them.
    const session = await host.create(join(dir, 'check.onnx'), { threads: 2, kernels: lib })
    for (const M of ROWS) {
      const feeds: Record<string, ort.Tensor> = {}
      SHAPES.forEach(([K], i) => { feeds[`x${i}`] = new ort.Tensor('float32', Float32Array.from({ length: M * K }, () => rand() * 4), [M, K]) })
      const out = await session.run(feeds)
      if (!SHAPES.every((_, i) => sameBits(out[`kernel${i}`]!.data as Float32Array, out[`mlas${i}`]!.data as Float32Array))) return false
    }
    return true
  } finally {
    await host.close()
    await rm(dir, { recursive: true, force: true })
  }
}
