/**
 * Per-peer link throughput for the pull decision (daemon/kv createLinkRates): a peer never measured
 * is judged at the probe rate (else a node whose prefill beats a pessimistic default never pulls,
 * so never measures its link), each peer's own pulls move only its own estimate, and a pull given
 * up for time caps the estimate at what the link can at most have done.
 */
import { describe, expect, it } from 'vitest'
import { createLinkRates, PROBE_LINK_BYTES_PER_SECOND, shouldPull } from '../../daemon/kv/index.ts'

describe('createLinkRates', () => {
  it('judges a peer never measured at the probe rate, so a node with a fast measured prefill still tries a LAN pull once', () => {
    const links = createLinkRates()
    expect(links.estimate('A')).toEqual({ bytesPerSecond: PROBE_LINK_BYTES_PER_SECOND, measured: false })
    // The `small` test model (3 KiB of f32 KV per token) on a CPU that prefills 8,000 tokens/s: at
    // the old 100 Mbit/s default this never pulled, and so never learned the link was loopback.
    const cost = { tokens: 900, bytesPerToken: 3072, rttMs: 1, prefillTokensPerSecond: 8_000 }
    expect(shouldPull({ ...cost, linkBytesPerSecond: 12_500_000 })).toBe(false)
    expect(shouldPull({ ...cost, linkBytesPerSecond: links.estimate('A').bytesPerSecond })).toBe(true)
  })

  it('keeps a moving average per peer: one slow peer does not veto a fast one', () => {
    const links = createLinkRates()
    links.record('fast', 1_000_000_000, 1_000)
    links.record('slow', 1_000_000, 1_000)
    expect(links.estimate('fast')).toEqual({ bytesPerSecond: 1e9, measured: true })
    expect(links.estimate('slow')).toEqual({ bytesPerSecond: 1e6, measured: true })
    links.record('fast', 500_000_000, 1_000)
    expect(links.estimate('fast').bytesPerSecond).toBeCloseTo(0.7 * 1e9 + 0.3 * 5e8, 0)
    // Nonsense (no bytes, no time) is no measurement.
    links.record('other', 0, 10)
    links.record('other', 10, 0)
    expect(links.estimate('other').measured).toBe(false)
  })

  it('caps a peer at what a pull given up for time shows its link did at most, and never raises it that way', () => {
    const links = createLinkRates()
    // A probe of 9 MB given up after 3 s: the link did less than 3 MB/s; the next pull is judged at that.
    links.recordTimeout('wan', 9_000_000, 3_000)
    expect(links.estimate('wan')).toEqual({ bytesPerSecond: 3_000_000, measured: true })
    links.recordTimeout('wan', 9_000_000, 1_000)
    expect(links.estimate('wan').bytesPerSecond).toBe(3_000_000)
    links.record('lan', 100_000_000, 100)
    links.recordTimeout('lan', 1_000_000, 100)
    expect(links.estimate('lan').bytesPerSecond).toBe(10_000_000)
  })

  it('remembers a bounded number of peers, forgetting the least recently measured', () => {
    const links = createLinkRates(2)
    links.record('a', 1e6, 1)
    links.record('b', 1e6, 1)
    links.record('a', 1e6, 1)
    links.record('c', 1e6, 1)
    expect(links.estimate('b').measured).toBe(false)
    expect(links.estimate('a').measured).toBe(true)
    expect(links.estimate('c').measured).toBe(true)
  })
})
