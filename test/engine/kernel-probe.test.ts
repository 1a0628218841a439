/**
 * The one-position attention's probe: the decision is a pure threshold (grouped only when it is
 * faster by GROUPED_MARGIN, a near tie keeping per-head), and the timing of both forms on this
 * CPU gives a form that decision takes from its own ratio, once per process and shape. No timed
 * assertions: which form wins is the CPU's (docs/engine-notes.md, wave 19).
 */
import { describe, expect, it } from 'vitest'
import { chooseDecodeAttention, decodeAttentionForm, int4BatchingVerdict } from '../../daemon/engine/index.ts'
import { GROUPED_MARGIN } from '../../daemon/engine/kernel-probe.ts'

describe('int4 batching verdict', () => {
  it('says bit-exact only for row-invariant kernels', () => {
    expect(int4BatchingVerdict({ rowInvariant: true, maxDiff: 0 })).toBe('bit-exact')
    expect(int4BatchingVerdict({ rowInvariant: false, maxDiff: 2e-6 })).toBe('exact to rounding')
  })
})

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
