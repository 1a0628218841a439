/**
 * runExpertStep with in-process links that play holders whose experts are the identity: the
 * output is base + Σ weight · row; a holder whose link fails is excluded and its replica answers;
 * a codec refusal fails the step at once instead of excluding healthy holders; an aborted signal
 * stops the step.
 */
import { describe, expect, it } from 'vitest'
import { decodePayload, encodePayloadParts, runExpertStep, type ExpertLink, type ExpertStepInput, type LayerPlacement } from '../../daemon/experts/index.ts'

const placement: LayerPlacement = { layer: 2, holders: [['a', 'b'], ['b'], ['c']], load: [1 / 3, 1 / 3, 1 / 3] }
const concat = (parts: Uint8Array[]): Uint8Array => Uint8Array.from(parts.flatMap(p => [...p]))

/** A holder whose every expert is the identity; records who was asked. */
function answer (peerId: string, parts: Uint8Array[], calls: string[]): Uint8Array {
  calls.push(peerId)
  const f = decodePayload(concat(parts))
  if (f.kind !== 'compute') throw new Error('compute expected')
  const out = new Float32Array(f.rows * f.width)
  for (const g of f.groups) g.rows.forEach((r, j) => { for (let d = 0; d < f.width; d++) out[r * f.width + d]! += g.weights[j]! * f.data[r * f.width + d]! })
  return concat(encodePayloadParts({ kind: 'partial', model: f.model, step: f.step, rows: f.rows, width: f.width, data: out }))
}

const input = (exclude = new Set<string>(), signal = AbortSignal.timeout(5000)): ExpertStepInput => ({
  model: 'm', step: 0, placement, rows: 3, width: 2,
  base: Float32Array.from([1, 1, 1, 1, 1, 1]),
  input: Float32Array.from([1, 2, 3, 4, 5, 6]),
  experts: [0, 1, 1, 2, 0, 2], weights: [0.75, 0.25, 0.5, 0.5, 0.125, 0.875], topK: 2, exclude, signal,
})
// Identity experts: every row's weights sum to 1, so out = base + row.
const want = [2, 3, 4, 5, 6, 7]

describe('runExpertStep', () => {
  it('sends each holder its rows once and adds the weighted sums to the base', async () => {
    const calls: string[] = []
    const r = await runExpertStep(input(), async (peerId, parts) => answer(peerId, parts, calls))
    expect(Array.from(r.out)).toEqual(want)
    expect(calls.sort()).toEqual(['a', 'b', 'c'])
    expect(r.routed).toEqual([2, 2, 2])
    expect(r.bytesOut).toBeGreaterThan(0)
  })

  it('a lost holder is excluded and its replica answers', async () => {
    const calls: string[] = []
    const exclude = new Set<string>()
    const link: ExpertLink = async (peerId, parts) => {
      if (peerId === 'a') throw Object.assign(new Error('gone'), { code: 'SHOAL_ERR_PEER_LOST' })
      return answer(peerId, parts, calls)
    }
    const r = await runExpertStep(input(exclude), link)
    expect(Array.from(r.out)).toEqual(want)
    expect([...exclude]).toEqual(['a'])
  })

  it('a codec refusal fails the step and excludes nobody', async () => {
    const exclude = new Set<string>()
    const link: ExpertLink = async (peerId, parts) => {
      const f = decodePayload(concat(parts))
      return concat(encodePayloadParts({ kind: 'error', model: 'm', step: f.step, error: { name: 'ExpertWireError', code: 'SHOAL_ERR_EXPERTS_MALFORMED', message: 'bad' } }))
    }
    await expect(runExpertStep(input(exclude), link)).rejects.toMatchObject({ code: 'SHOAL_ERR_EXPERTS_MALFORMED' })
    expect(exclude.size).toBe(0)
  })

  it('every copy of a chosen expert lost: ExpertsLostError, code SHOAL_ERR_PEER_LOST', async () => {
    await expect(runExpertStep(input(new Set(['c'])), async (p, parts) => answer(p, parts, []))).rejects.toMatchObject({ name: 'ExpertsLostError', code: 'SHOAL_ERR_PEER_LOST', layer: 2, expert: 2 })
  })

  it('an aborted signal stops the step', async () => {
    const ctl = new AbortController()
    ctl.abort(new Error('client went away'))
    await expect(runExpertStep(input(new Set(), ctl.signal), async (p, parts) => answer(p, parts, []))).rejects.toThrow('client went away')
  })
})
