/**
 * The pull decision (daemon/kv shouldPull): pull a peer's prefix only when moving its KV, round
 * trip included, is cheaper than prefilling it here by the margin; anything unknown says recompute.
 */
import fc from 'fast-check'
import { describe, expect, it } from 'vitest'
import { DEFAULT_PULL_MARGIN, MIN_PULL_WAIT_MS, pullCost, pullWaitMs, shouldPull } from '../../daemon/kv/index.ts'
import type { PullCostInput } from '../../daemon/kv/index.ts'

/** A 60m-class model (8 layers, 2 KV heads of 64): 8 KiB of f32 KV per token. */
const base: PullCostInput = { tokens: 2000, bytesPerToken: 8192, linkBytesPerSecond: 125_000_000, rttMs: 1, prefillTokensPerSecond: 4000 }

describe('shouldPull', () => {
  it('costs the transfer as a round trip plus bytes over the link, and recomputation as tokens over the prefill rate', () => {
    const { transferMs, recomputeMs } = pullCost(base)
    expect(transferMs).toBeCloseTo(1 + 2000 * 8192 / 125_000_000 * 1000, 6) // ≈ 132 ms
    expect(recomputeMs).toBeCloseTo(500, 6)
  })

  it('pulls a long history over a fast LAN, recomputes over a slow or distant link', () => {
    expect(shouldPull(base)).toBe(true)
    expect(shouldPull({ ...base, linkBytesPerSecond: 12_500_000 })).toBe(false) // 100 Mbit/s: 1.3 s to move
    expect(shouldPull({ ...base, rttMs: 450 })).toBe(false)
    // A fast prefill (GPU-class) beats any 1 Gbit/s transfer of the same tokens.
    expect(shouldPull({ ...base, prefillTokensPerSecond: 50_000 })).toBe(false)
  })

  it('needs the margin: a transfer only just cheaper than recomputing is not worth it', () => {
    // Recompute 500 ms; transfer exactly 450 ms (1 ms RTT + 449 ms of bytes).
    const close = { ...base, linkBytesPerSecond: 2000 * 8192 / 0.449 }
    expect(pullCost(close).transferMs).toBeCloseTo(450, 6)
    expect(shouldPull(close)).toBe(false)
    expect(shouldPull({ ...close, margin: 0.1 })).toBe(true)
    expect(DEFAULT_PULL_MARGIN).toBeGreaterThan(0)
  })

  it('says no to what it cannot judge: no tokens, zero or non-finite rates', () => {
    for (const bad of [{ tokens: 0 }, { linkBytesPerSecond: 0 }, { prefillTokensPerSecond: 0 }, { bytesPerToken: 0 }, { rttMs: Number.NaN }, { linkBytesPerSecond: Number.POSITIVE_INFINITY }, { tokens: -5 }]) {
      expect(shouldPull({ ...base, ...bad })).toBe(false)
    }
  })

  it('is monotone: more tokens never turn a yes into a no; a slower link or a faster prefill never turn a no into a yes', () => {
    const input = fc.record({
      tokens: fc.integer({ min: 1, max: 100_000 }),
      bytesPerToken: fc.integer({ min: 1, max: 1 << 20 }),
      linkBytesPerSecond: fc.integer({ min: 1, max: 1e10 }),
      rttMs: fc.double({ min: 0, max: 1000, noNaN: true }),
      prefillTokensPerSecond: fc.double({ min: 1, max: 1e6, noNaN: true }),
    })
    fc.assert(fc.property(input, fc.integer({ min: 1, max: 10 }), (i, k) => {
      if (shouldPull(i)) expect(shouldPull({ ...i, tokens: i.tokens * k })).toBe(true)
      if (!shouldPull(i)) {
        expect(shouldPull({ ...i, linkBytesPerSecond: i.linkBytesPerSecond / k })).toBe(false)
        expect(shouldPull({ ...i, prefillTokensPerSecond: i.prefillTokensPerSecond * k })).toBe(false)
      }
    }))
  })
})

describe('pullWaitMs', () => {
  it('gives a pull twice the recomputation it replaces, at least MIN_PULL_WAIT_MS, in whole milliseconds a timer accepts', () => {
    expect(pullWaitMs(base)).toBe(MIN_PULL_WAIT_MS) // recompute 500 ms
    // 2000 tokens at 153 tokens/s: 13,071.9 ms to recompute — a fraction AbortSignal.timeout refuses.
    const slow = { ...base, prefillTokensPerSecond: 153 }
    expect(pullWaitMs(slow)).toBe(Math.ceil(2 * 2000 / 153 * 1000))
    expect(() => AbortSignal.timeout(pullWaitMs(slow))).not.toThrow()
    expect(pullWaitMs({ ...base, prefillTokensPerSecond: 1e-9 })).toBe(2 ** 31 - 1)
    expect(pullWaitMs({ ...base, prefillTokensPerSecond: 0 })).toBe(MIN_PULL_WAIT_MS)
  })
})
