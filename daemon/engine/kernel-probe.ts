/**
 * Whether this CPU's onnxruntime MatMulNBits gives a row of an M-row run exactly the bits of its
 * one-row run. On AVX-512 VNNI it does; on AVX2-only CPUs MLAS computes one-row int4 runs with a
 * kernel of their own (blocks of 32–128, either accuracy level), whose rounding differs from the
 * M-row kernel's by a few 1e-6 — enough, over dozens of greedy steps, for a sequence batched with
 * others to part from its batch-of-one tokens at a near tie (docs/engine-notes.md, wave 7). The
 * daemon asks once when it serves an int4 model and says which holds in its 'model loaded' line;
 * the tests that promise bit-exact batching of int4 shards ask too.
 *
 * The probe runs on a session worker (off-thread-sessions.ts), never on the caller's event loop.
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import * as ort from 'onnxruntime-node'
import { DT, GraphBuilder, MS_DOMAIN } from '../../shards/graph/builder.ts'
import { quantizeMatrix } from '../../shards/quant.ts'
import { createOffThreadSessions } from './off-thread-sessions.ts'

export interface RowInvariance {
  /** A row's bits do not depend on how many rows share the run. */
  rowInvariant: boolean
  /** Largest |one-row − M-row| over the probe's outputs (0 when row-invariant). */
  maxDiff: number
}

const memo = new Map<string, Promise<RowInvariance>>()

/**
 * One MatMulNBits (int4, K 256, N 384, `blockSize`, `accuracyLevel` 4 = int8 activations, 0 = f32)
 * run on 4 rows at once and on each alone, compared bit for bit. Memoized per process: the answer
 * is the CPU's and onnxruntime's, not the run's.
 */
export async function matMulNBitsRowInvariance (accuracyLevel: number, blockSize = 32): Promise<RowInvariance> {
  const key = `${accuracyLevel}/${blockSize}`
  let p = memo.get(key)
  if (p === undefined) {
    memo.set(key, p = probe(accuracyLevel, blockSize))
    p.catch(() => { memo.delete(key) }) // a failed probe (a full tmpdir, say) may be asked again
  }
  return await p
}

async function probe (accuracyLevel: number, blockSize: number): Promise<RowInvariance> {
  const K = 256
  const N = 384
  const M = 4
  // A fixed pseudo-random sequence: the verdict must not depend on the run.
  let s = 12345
  const rand = (): number => { s = (s * 1103515245 + 12345) % 2147483648; return s / 2147483648 - 0.5 }
  const dir = await mkdtemp(join(tmpdir(), 'shoal-kernel-probe-'))
  const host = createOffThreadSessions()
  try {
    const g = new GraphBuilder('model.onnx.data')
    const x = g.input('x', DT.FLOAT, ['m', K])
    const q = quantizeMatrix(Float32Array.from({ length: N * K }, rand), N, K, 4, blockSize)
    const blocks = Math.ceil(K / blockSize)
    const qw = g.weight('w.q', DT.UINT8, [N, blocks, blockSize / 2], q.data)
    const sc = g.weight('w.s', DT.FLOAT, [N * blocks], new Uint8Array(q.scales.buffer))
    g.output('y', g.op('MatMulNBits', '/probe', [x, qw, sc], { K, N, bits: 4, block_size: blockSize, accuracy_level: accuracyLevel }, MS_DOMAIN), DT.FLOAT, ['m', N])
    await writeFile(join(dir, 'model.onnx'), g.encode('probe', 'MatMulNBits row invariance'))
    await writeFile(join(dir, 'model.onnx.data'), Buffer.concat(g.data()))
    const session = await host.create(join(dir, 'model.onnx'), { threads: 1 })
    const X = Float32Array.from({ length: M * K }, () => 2 * rand())
    const all = (await session.run({ x: new ort.Tensor('float32', X, [M, K]) })).y!.data as Float32Array
    let maxDiff = 0
    for (let r = 0; r < M; r++) {
      const one = (await session.run({ x: new ort.Tensor('float32', X.slice(r * K, (r + 1) * K), [1, K]) })).y!.data as Float32Array
      for (let j = 0; j < N; j++) maxDiff = Math.max(maxDiff, Math.abs(one[j]! - all[r * N + j]!))
    }
    return { rowInvariant: maxDiff === 0, maxDiff }
  } finally {
    await host.close()
    await rm(dir, { recursive: true, force: true })
  }
}
