/** The mesh's pure decisions and the peer table, without a network. */
import { describe, expect, it } from 'vitest'
import fc from 'fast-check'
import { backoffDelay, chooseRecord, firstDialDelay, decideAdmission, expiresSoon, livenessState, reviewAdmission, RTT_WINDOW, rttEstimate } from '../../daemon/mesh/decisions.ts'
import { PeerTable } from '../../daemon/mesh/peer-table.ts'
import { DEFAULT_TIMINGS } from '../../daemon/mesh/types.ts'
import { capabilityBody } from '../../daemon/mesh/wire/caps.ts'
import type { NodeCertificate } from '../../certs/index.ts'

describe('decideAdmission', () => {
  it('is mutual: admitted only when we verified them and they accepted us', () => {
    expect(decideAdmission({ admitted: true }, { state: 'accepted' })).toEqual({ state: 'admitted' })
    expect(decideAdmission({ admitted: true }, { state: 'pending' })).toEqual({ state: 'pending' })
    expect(decideAdmission(undefined, { state: 'accepted' })).toEqual({ state: 'pending' })
  })
  it('our refusal wins; a remote refusal is named as such', () => {
    expect(decideAdmission({ admitted: false, reason: 'revoked', detail: 'd' }, { state: 'accepted' })).toEqual({ state: 'refused', reason: 'revoked', detail: 'd', by: 'local' })
    expect(decideAdmission({ admitted: true }, { state: 'refused', reason: 'wrong-ca', detail: 'x' })).toEqual({ state: 'refused', reason: 'refused-by-peer:wrong-ca', detail: 'x', by: 'remote' })
  })
})

describe('reviewAdmission', () => {
  it('ends admission on revocation or expiry', () => {
    expect(reviewAdmission({ serial: 'a', notAfterMs: 100, revokedSerials: new Set(['a']), now: 0 })).toMatchObject({ admitted: false, reason: 'revoked' })
    expect(reviewAdmission({ serial: 'a', notAfterMs: 100, revokedSerials: ['b'], now: 101 })).toMatchObject({ admitted: false, reason: 'expired' })
    expect(reviewAdmission({ serial: 'a', notAfterMs: 100, revokedSerials: ['b'], now: 100 })).toEqual({ admitted: true })
  })
})

describe('livenessState', () => {
  it('alive → suspect → gone as silence grows', () => {
    const at = (silent: number): string => livenessState({ lastSeenMs: 1000, now: 1000 + silent, suspectAfterMs: 100, goneAfterMs: 500 })
    expect([at(0), at(99), at(100), at(499), at(500)]).toEqual(['alive', 'alive', 'suspect', 'suspect', 'gone'])
  })
  it('is monotone in silence (property)', () => {
    const rank = { alive: 0, suspect: 1, gone: 2 }
    fc.assert(fc.property(fc.nat(10_000), fc.nat(10_000), (a, b) => {
      const [x, y] = a <= b ? [a, b] : [b, a]
      const s = (t: number): number => rank[livenessState({ lastSeenMs: 0, now: t, suspectAfterMs: 2500, goneAfterMs: 10_000 })]
      return s(x) <= s(y)
    }))
  })
})

describe('chooseRecord', () => {
  const head = (seq: number, issuedAt = 0, peerId = 'p'): { peerId: string, seq: number, issuedAt: number } => ({ peerId, seq, issuedAt })
  it('takes only strictly newer records about the same peer, not from the far future', () => {
    expect(chooseRecord(undefined, head(1), 0, 10)).toBe('take')
    expect(chooseRecord(head(1), head(2), 0, 10)).toBe('take')
    expect(chooseRecord(head(2), head(2), 0, 10)).toBe('stale')
    expect(chooseRecord(head(3), head(2), 0, 10)).toBe('stale')
    expect(chooseRecord(head(1, 0, 'q'), head(2), 0, 10)).toBe('other-peer')
    expect(chooseRecord(head(1), head(2, 11), 0, 10)).toBe('future')
  })
})

describe('backoff and expiry', () => {
  it('doubles up to the ceiling, with jitter', () => {
    expect([0, 1, 2, 3, 10, 1000].map(a => backoffDelay(a, 100, 1000))).toEqual([100, 200, 400, 800, 1000, 1000])
    expect(backoffDelay(1, 100, 1000, 0)).toBe(150)
    expect(backoffDelay(1, 100, 1000, 0.999)).toBe(250)
  })
  it('breaks simultaneous dials: the smaller peer id dials first', () => {
    expect(firstDialDelay('a', 'b', 500)).toBe(0)
    expect(firstDialDelay('b', 'a', 500)).toBe(500)
  })
  it('flags certificates close to notAfter', () => {
    expect(expiresSoon(1000, 0, 999)).toBe(false)
    expect(expiresSoon(1000, 1, 999)).toBe(true)
  })
})

describe('PeerTable', () => {
  const cert = { body: { name: 'w1', roles: ['worker'], notAfter: '2099-01-01T00:00:00Z', serial: 'ab' } } as unknown as NodeCertificate
  const timings = { ...DEFAULT_TIMINGS, suspectAfterMs: 100, goneAfterMs: 300, capsTtlMs: 1000 }
  const record = (seq: number, peerId = 'p1'): ReturnType<typeof capabilityBody> =>
    capabilityBody({ peerId, name: 'w1', seq, issuedAt: 0, addrs: [], protocols: [], models: [{ id: 'm', layers: [0, 3] }] })

  it('holds admission, newest record, load and liveness; emits changes; drops the gone', () => {
    const table = new PeerTable(timings)
    const changes: string[] = []
    table.onChange(c => changes.push(`${c.kind}:${c.peerId}`))
    table.setPending('p1', 0)
    expect(table.snapshot(0)).toEqual([])
    table.setAdmitted('p1', cert, 0)
    expect(table.offerRecord(record(2), 0)).toBe('take')
    expect(table.offerRecord(record(1), 0)).toBe('stale')
    table.setLoad('p1', { queueDepth: 1, inFlight: 0, decodeTokPerSec: 0, freeKvTokens: 0, expectedWaitMs: 0 }, 3.21, 50)
    expect(table.snapshot(60)).toEqual([expect.objectContaining({ peerId: 'p1', name: 'w1', admitted: true, models: [{ id: 'm', layers: [0, 3] }], rttMs: 3.2, state: 'alive' })])
    table.sweep(200)
    expect(table.snapshot(200)[0]?.state).toBe('suspect')
    expect(table.sweep(400)).toEqual(['p1'])
    expect(table.snapshot(400)).toEqual([])
    expect(changes).toEqual(['admitted:p1', 'capabilities:p1', 'load:p1', 'liveness:p1', 'gone:p1'])
  })

  it('a peer\'s RTT is the least of its last load round trips: one late answer does not make it look far', () => {
    expect(rttEstimate([])).toBeUndefined()
    expect(rttEstimate([3, 25, 4])).toBe(3)
    expect(rttEstimate([NaN, -1, 7])).toBe(7)
    const table = new PeerTable(timings)
    table.setAdmitted('p1', cert, 0)
    const load = { queueDepth: 0, inFlight: 0, decodeTokPerSec: 0, freeKvTokens: 0, expectedWaitMs: 0 }
    const rtt = (): number | undefined => table.snapshot(0)[0]?.rttMs
    table.setLoad('p1', load, 1.2, 10)
    table.setLoad('p1', load, 25, 20)
    expect(rtt()).toBe(1.2)
    // The path got slower: once the fast sample leaves the window, the estimate follows.
    for (let i = 0; i < RTT_WINDOW; i++) table.setLoad('p1', load, 9 + i, 30 + i)
    expect(rtt()).toBe(9)
    // Refused: what was measured goes with the rest of what it claimed.
    table.setRefused('p1', 'revoked', 'x', 100)
    table.setAdmitted('p1', cert, 110)
    table.setLoad('p1', load, 30, 120)
    expect(rtt()).toBe(30)
  })

  it('a refused peer shows its reason and nothing it claimed', () => {
    const table = new PeerTable(timings)
    table.setAdmitted('p1', cert, 0)
    table.offerRecord(record(1), 0)
    table.setRefused('p1', 'revoked', 'serial ab', 1)
    expect(table.snapshot(1)).toEqual([expect.objectContaining({ peerId: 'p1', admitted: false, reason: 'revoked', models: [] })])
    expect(table.views()).toEqual([])
    expect(table.offerRecord(record(5), 2)).toBe('stale')
  })

  it('a refused peer is alive only while it was heard from recently, not for as long as it is listed (issue 13 #6)', () => {
    const table = new PeerTable(timings)
    table.setAdmitted('p1', cert, 0)
    table.setLoad('p1', { queueDepth: 0, inFlight: 0, decodeTokPerSec: 0, freeKvTokens: 0, expectedWaitMs: 0 }, 1, 50)
    table.setRefused('p1', 'revoked', 'serial ab', 60)
    table.setPending('p2', 60)
    table.setRefused('p2', 'wrong-ca', 'x', 70)
    expect(table.snapshot(80).map(p => p.state)).toEqual(['alive', 'alive'])
    // Killed: nothing more is heard; the sweep keeps them listed (with their reasons) but not alive.
    for (const t of [200, 500, 900]) {
      table.sweep(t)
      expect(table.snapshot(t)).toEqual([
        expect.objectContaining({ peerId: 'p1', admitted: false, reason: 'revoked', state: 'suspect' }),
        expect.objectContaining({ peerId: 'p2', admitted: false, reason: 'wrong-ca', state: 'suspect' }),
      ])
    }
    // Heard from again (another refused handshake): alive again.
    table.setRefused('p2', 'wrong-ca', 'x', 950)
    expect(table.snapshot(960).find(p => p.peerId === 'p2')?.state).toBe('alive')
  })

  it('a listener that throws does not break the table', () => {
    const errors: unknown[] = []
    const table = new PeerTable(timings, err => errors.push(err))
    table.onChange(() => { throw new Error('boom') })
    table.setAdmitted('p1', cert, 0)
    expect(errors).toHaveLength(1)
    expect(table.isAdmitted('p1')).toBe(true)
  })
})
