/**
 * A node that just joined the mesh answers a model it has not heard of with 503 (not known here
 * yet, retry), and with 404 only once peers' capability records have had time to arrive. The
 * chaos suite found a restarted ingress answering 404 for the mesh's own models (reproduction/
 * chaos.ts); test/e2e/chaos.test.ts checks the same through real processes.
 */
import { describe, expect, it } from 'vitest'
import { createRoutedService, joiningReason } from '../../daemon/routing/index.ts'
import type { GenerateRequest } from '../../daemon/service.ts'

const request: GenerateRequest = {
  requestId: 'join-1',
  model: 'sim-1',
  prompt: { kind: 'chat', messages: [{ role: 'user', content: 'hi' }] },
  maxTokens: 5,
  sampling: { temperature: 0, topP: 1 },
  stop: [],
  deadline: Number.MAX_SAFE_INTEGER,
}

async function codeOf (gen: AsyncIterable<unknown>): Promise<string | undefined> {
  try {
    for await (const _ of gen) { /* drain */ }
  } catch (err) {
    return (err as { code?: string }).code
  }
  return undefined
}

describe('joiningReason', () => {
  it('says why only inside the window, and never with the window off', () => {
    expect(joiningReason(0, 15_000)).toMatch(/joined the mesh 0\.0 s ago .* up to 15 s/)
    expect(joiningReason(14_999, 15_000)).toBeDefined()
    expect(joiningReason(15_000, 15_000)).toBeUndefined()
    expect(joiningReason(60_000, 15_000)).toBeUndefined()
    expect(joiningReason(0, 0)).toBeUndefined()
    expect(joiningReason(Number.NaN, 15_000)).toBeUndefined()
  })
})

describe('a model no node is known to serve', () => {
  it('is a 503 (retry) inside the join window and a 404 after it', async () => {
    let now = 1_000_000
    const routed = createRoutedService({ now: () => now, joinWindowMs: 15_000 }, { candidates: () => [], forward: () => { throw new Error('no peers') } })
    expect(await codeOf(routed.generate(request, new AbortController().signal))).toBe('SHOAL_ERR_NO_ELIGIBLE_NODE')
    now += 14_000
    expect(await codeOf(routed.generate(request, new AbortController().signal))).toBe('SHOAL_ERR_NO_ELIGIBLE_NODE')
    now += 1_000
    expect(await codeOf(routed.generate(request, new AbortController().signal))).toBe('SHOAL_ERR_MODEL_NOT_FOUND')
  })

  it('is a 404 at once without a join window (a node outside a mesh)', async () => {
    const routed = createRoutedService({ now: () => 0 }, { candidates: () => [], forward: () => { throw new Error('no peers') } })
    expect(await codeOf(routed.generate(request, new AbortController().signal))).toBe('SHOAL_ERR_MODEL_NOT_FOUND')
  })
})
