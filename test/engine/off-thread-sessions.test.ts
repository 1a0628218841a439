/**
 * Off-thread sessions (the MoE stage's and the expert holders' graphs): runs happen on a worker
 * thread, never the caller's (onnxruntime-node computes on the thread that calls `run`), with
 * exactly the outputs of a session run in place, the caller's feeds left intact, and a clean
 * error after close; timed runs (the kernel probe's) likewise.
 */
import { threadId } from 'node:worker_threads'
import * as ort from 'onnxruntime-node'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createOffThreadSessions } from '../../daemon/engine/off-thread-sessions.ts'
import { buildTinyModel } from './tiny-model.ts'
import type { TinyModel } from './tiny-model.ts'

describe('off-thread sessions', () => {
  let model: TinyModel
  beforeAll(async () => { model = await buildTinyModel('llama', 'standard') })
  afterAll(async () => { await model?.cleanup() })

  it('run on a worker thread and give exactly what the session gives in place', async () => {
    const host = createOffThreadSessions()
    const local = await ort.InferenceSession.create(model.graphPath, { intraOpNumThreads: 1, interOpNumThreads: 1 })
    const remote = await host.create(model.graphPath, { threads: 1 })
    expect(remote.threadId).not.toBe(threadId)
    expect([...remote.inputNames]).toEqual([...local.inputNames])
    const s = model.manifest.shape
    const ids = BigInt64Array.from([5n, 17n, 99n, 3n])
    // The ids as a view of a larger buffer: the caller's array must stay usable afterwards.
    const backing = new BigInt64Array(16)
    backing.set(ids, 4)
    const view = backing.subarray(4, 8)
    const feeds = (): Record<string, ort.Tensor> => {
      const f: Record<string, ort.Tensor> = {
        input_ids: new ort.Tensor('int64', view, [1, 4]),
        position_ids: new ort.Tensor('int64', BigInt64Array.from([0n, 1n, 2n, 3n]), [1, 4]),
        attention_mask: new ort.Tensor('int64', BigInt64Array.from([1n, 1n, 1n, 1n]), [1, 4]),
        num_logits_to_keep: new ort.Tensor('int64', BigInt64Array.of(2n), []),
      }
      for (const name of local.inputNames) {
        if (name.startsWith('past_key_values')) f[name] = new ort.Tensor('float32', new Float32Array(0), [1, s.numKvHeads, 0, s.headDim])
      }
      return Object.fromEntries(Object.entries(f).filter(([n]) => local.inputNames.includes(n)))
    }
    const want = await local.run(feeds())
    const got = await remote.run(feeds())
    expect(Object.keys(got).sort()).toEqual(Object.keys(want).sort())
    for (const name of Object.keys(want)) {
      expect([...got[name]!.dims]).toEqual([...want[name]!.dims])
      expect(Buffer.from((got[name]!.data as Float32Array).buffer).equals(Buffer.from((want[name]!.data as Float32Array).buffer))).toBe(true)
    }
    expect([...view]).toEqual([...ids])
    await remote.release()
    await local.release()
    await host.close()
    await expect(host.create(model.graphPath)).resolves.toMatchObject({ inputNames: local.inputNames })
    await host.close()
  })

  it('time the same feeds the asked number of times on the worker (the kernel probe), leaving the caller its arrays', async () => {
    const host = createOffThreadSessions()
    try {
      const session = await host.create(model.graphPath, { threads: 1 })
      const s = model.manifest.shape
      const ids = BigInt64Array.from([5n, 17n])
      const feeds: Record<string, ort.Tensor> = {
        input_ids: new ort.Tensor('int64', ids, [1, 2]),
        position_ids: new ort.Tensor('int64', BigInt64Array.from([0n, 1n]), [1, 2]),
        attention_mask: new ort.Tensor('int64', BigInt64Array.from([1n, 1n]), [1, 2]),
        num_logits_to_keep: new ort.Tensor('int64', BigInt64Array.of(1n), []),
      }
      for (const name of session.inputNames) {
        if (name.startsWith('past_key_values')) feeds[name] = new ort.Tensor('float32', new Float32Array(0), [1, s.numKvHeads, 0, s.headDim])
      }
      const ms = await session.time(Object.fromEntries(Object.entries(feeds).filter(([n]) => session.inputNames.includes(n))), 3)
      expect(ms).toHaveLength(3)
      expect(ms.every(t => Number.isFinite(t) && t >= 0)).toBe(true)
      expect([...ids]).toEqual([5n, 17n])
    } finally {
      await host.close()
    }
  })
})
