/**
 * The chaos suite's verdict on each request (reproduction/chaos/verdict.ts), from plain facts:
 * what counts as a clean error, a hang, a wrong or unreceipted 200, and the per-phase tally.
 */
import { describe, expect, it } from 'vitest'
import { classifyFailure, classifySuccess, tally } from '../../reproduction/chaos/index.ts'
import type { FailureFacts, Outcome } from '../../reproduction/chaos/index.ts'

const facts = (over: Partial<FailureFacts>): FailureFacts => ({ timedOut: false, connection: false, ingressDown: false, shaped: true, code: 'SHOAL_ERR_PEER_UNAVAILABLE', type: 'server_error', status: 503, ...over })

describe('classifyFailure', () => {
  it('a retryable status with a SHOAL_ERR code in OpenAI\'s shape is clean', () => {
    for (const status of [429, 502, 503, 504]) expect(classifyFailure(facts({ status }))).toBe('clean-error')
  })
  it('an error event mid-stream (no status of its own) with a code is clean', () => {
    expect(classifyFailure(facts({ status: undefined, code: 'SHOAL_ERR_PEER_LOST' }))).toBe('clean-error')
  })
  it('a 404 or 500, an error without a code or outside the shape is not', () => {
    expect(classifyFailure(facts({ status: 404, code: 'SHOAL_ERR_MODEL_NOT_FOUND' }))).toBe('unclean-error')
    expect(classifyFailure(facts({ status: 500, code: 'SHOAL_ERR_INTERNAL' }))).toBe('unclean-error')
    expect(classifyFailure(facts({ code: null }))).toBe('unclean-error')
    expect(classifyFailure(facts({ code: 'ECONNRESET' }))).toBe('unclean-error')
    expect(classifyFailure(facts({ shaped: false }))).toBe('unclean-error')
  })
  it('the bound firing is a hang, whatever else is true', () => {
    expect(classifyFailure(facts({ timedOut: true }))).toBe('hang')
    expect(classifyFailure(facts({ timedOut: true, connection: true, ingressDown: true }))).toBe('hang')
  })
  it('no HTTP answer is expected only from an ingress the suite took down', () => {
    expect(classifyFailure(facts({ connection: true, ingressDown: true }))).toBe('ingress-down')
    expect(classifyFailure(facts({ connection: true, ingressDown: false }))).toBe('unclean-error')
  })
})

describe('classifySuccess', () => {
  const ok = { finishReason: 'length', tokenIds: [1, 2, 3], expected: [1, 2, 3], receiptId: 'r1' }
  it('whole, exact and receipted is ok', () => { expect(classifySuccess(ok)).toBe('ok') })
  it('no finish reason is an empty 200', () => { expect(classifySuccess({ ...ok, finishReason: null })).toBe('empty') })
  it('other tokens, fewer tokens or no reference are wrong', () => {
    expect(classifySuccess({ ...ok, tokenIds: [1, 2, 4] })).toBe('wrong')
    expect(classifySuccess({ ...ok, tokenIds: [1, 2] })).toBe('wrong')
    expect(classifySuccess({ ...ok, expected: undefined })).toBe('wrong')
  })
  it('a 200 naming no receipt fails', () => { expect(classifySuccess({ ...ok, receiptId: null })).toBe('no-receipt') })
})

describe('tally', () => {
  it('counts per phase: sent, ok, clean errors by status and code, failures by kind', () => {
    const o = (kind: Outcome['kind'], phase: string, over: Partial<Outcome> = {}): Outcome => ({ kind, phase, ingress: 'a', model: 'm', stream: false, ms: 10, ...over })
    const rows = tally([
      o('ok', 'p1'), o('ok', 'p1', { ms: 30 }), o('clean-error', 'p1', { status: 503, code: 'SHOAL_ERR_NO_ELIGIBLE_NODE' }),
      o('clean-error', 'p2', { code: 'SHOAL_ERR_PEER_LOST' }), o('hang', 'p2'), o('wrong', 'p2'), o('ingress-down', 'p2'),
    ])
    expect(rows.map(r => r.phase)).toEqual(['p1', 'p2'])
    expect(rows[0]).toMatchObject({ sent: 3, ok: 2, clean: 1, failures: 0, maxMs: 30, errors: { '503 SHOAL_ERR_NO_ELIGIBLE_NODE': 1 } })
    expect(rows[1]).toMatchObject({ sent: 4, ok: 0, clean: 1, ingressDown: 1, failures: 2, hangs: 1, wrong: 1, errors: { 'stream SHOAL_ERR_PEER_LOST': 1 } })
    expect(Object.keys(rows[1]!.failed).sort()).toEqual(['hang', 'wrong'])
  })
})
