/**
 * The one-position attention's probe: the decision is a pure threshold (grouped only when it is
 * faster by GROUPED_MARGIN, a near tie keeping per-head), and the timing of both forms on this
 * CPU gives a form that decision takes from its own ratio, once per process and shape. No timed
 * assertions: which form wins is the CPU's (docs/engine-notes.md, wave 19).
 */
import * as ort from 'onnxruntime-node'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { chooseDecodeAttention, decodeAttentionForm } from '../../daemon/engine/index.ts'
import { GROUPED_MARGIN } from '../../daemon/engine/kernel-probe.ts'
import { createOffThreadSessions } from '../../daemon/engine/off-thread-sessions.ts'
import { buildTinyModel, type TinyModel } from './tiny-model.ts'

describe('decode attention probe', () => {
  it('takes grouped only when it is faster by the margin', () => {
    expect(chooseDecodeAttention(0.8)).toBe('grouped')
    expect(chooseDecodeAttention(GROUPED_MARGIN)).toBe('grouped')
    expect(chooseDecodeAttention(GROUPED_MARGIN + 0.001)).toBe('per-head')
    expect(chooseDecodeAttention(1)).toBe('per-head')
    expect(chooseDecodeAttention(1.3)).toBe('per-head')
  })

  it('times both forms at a head shape and answers once per process and shape', async () => {
    const shape = { numHeads: 8, numKvHeads: 2, headDim: 64 }
    const a = await decodeAttentionForm(shape)
    console.log(`this CPU: grouped/per-head ${a.ratio.toFixed(3)} → ${a.form}`)
    expect(Number.isFinite(a.ratio) && a.ratio > 0).toBe(true)
    expect(a.form).toBe(chooseDecodeAttention(a.ratio))
    expect(await decodeAttentionForm({ ...shape })).toBe(a)
    // One kv head per query head (no grouping) is a shape the probe takes too.
    const b = await decodeAttentionForm({ numHeads: 4, numKvHeads: 4, headDim: 32 })
    expect(b.form).toBe(chooseDecodeAttention(b.ratio))
  })
})

describe('off-thread session timing', () => {
  let model: TinyModel
  beforeAll(async () => { model = await buildTinyModel('llama', 'standard') })
  afterAll(async () => { await model?.cleanup() })

  it('runs the same feeds the asked number of times on the worker, leaving the caller its arrays', async () => {
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
      const ms = await session.time(feeds, 3)
      expect(ms).toHaveLength(3)
      expect(ms.every(t => Number.isFinite(t) && t >= 0)).toBe(true)
      expect([...ids]).toEqual([5n, 17n])
    } finally {
      await host.close()
    }
  })
})
