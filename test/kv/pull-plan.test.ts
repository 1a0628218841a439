/**
 * One pull as both a whole-model node and a chain stage make it (daemon/kv pull-plan.ts): the
 * plan — whether it pays (shouldPull over measured or default rates) and how long it may take —
 * and the bounded run, which learns the link's rate, counts the outcome, turns every failure into
 * a fallback and lets only the request's own abort through.
 */
import { Registry } from 'prom-client'
import { describe, expect, it } from 'vitest'
import {
  createLinkRates, createPrefixMetrics, DEFAULT_LINK_RTT_MS, DEFAULT_PREFILL_TOKENS_PER_SECOND, MIN_PULL_WAIT_MS, planPull, pullWaitMs, runPull,
} from '../../daemon/kv/index.ts'
import type { PullOutcome, PullPlanInput } from '../../daemon/kv/index.ts'

const base: PullPlanInput = { gain: 2000, minTokens: 16, bytesPerToken: 8192, linkBytesPerSecond: 125_000_000, rttMs: 1, prefillTokensPerSecond: 4000 }

describe('planPull', () => {
  it('plans a pull that pays, bounded by twice the recomputation it replaces', () => {
    const plan = planPull(base)!
    expect(plan.cost).toEqual({ tokens: 2000, bytesPerToken: 8192, linkBytesPerSecond: 125_000_000, rttMs: 1, prefillTokensPerSecond: 4000 })
    expect(plan.waitMs).toBe(pullWaitMs(plan.cost))
    // Recomputing takes 500 ms: the least wait applies; a slower prefill earns a longer one.
    expect(plan.waitMs).toBe(MIN_PULL_WAIT_MS)
    expect(planPull({ ...base, prefillTokensPerSecond: 400 })!.waitMs).toBe(10_000)
  })

  it('says recompute below the least gain, when it does not pay, and for nonsense', () => {
    expect(planPull({ ...base, gain: 15 })).toBeUndefined()
    expect(planPull({ ...base, gain: 0, minTokens: 0 })).toBeUndefined()
    expect(planPull({ ...base, gain: Number.NaN })).toBeUndefined()
    expect(planPull({ ...base, linkBytesPerSecond: 12_500_000 })).toBeUndefined()
    expect(planPull({ ...base, prefillTokensPerSecond: 50_000 })).toBeUndefined()
    expect(planPull({ ...base, bytesPerToken: 0 })).toBeUndefined()
  })

  it('judges what was not measured at the defaults, and lets a policy decide instead', () => {
    const plan = planPull({ ...base, rttMs: undefined, prefillTokensPerSecond: undefined })!
    expect(plan.cost.rttMs).toBe(DEFAULT_LINK_RTT_MS)
    expect(plan.cost.prefillTokensPerSecond).toBe(DEFAULT_PREFILL_TOKENS_PER_SECOND)
    expect(planPull({ ...base, policy: () => false })).toBeUndefined()
    const seen: unknown[] = []
    expect(planPull({ ...base, linkBytesPerSecond: 1, policy: c => { seen.push(c); return true } })?.waitMs).toBe(MIN_PULL_WAIT_MS)
    expect(seen).toHaveLength(1)
    // The policy still sees only sensible gains.
    expect(planPull({ ...base, gain: 3, policy: () => true })).toBeUndefined()
  })
})

describe('runPull', () => {
  const plan = planPull(base)!
  const setup = (): { registry: Registry, metrics: ReturnType<typeof createPrefixMetrics>, links: ReturnType<typeof createLinkRates> } => {
    const registry = new Registry()
    return { registry, metrics: createPrefixMetrics(registry), links: createLinkRates() }
  }
  const value = async (r: Registry, name: string, labels: string): Promise<number> => {
    const line = (await r.metrics()).split('\n').find(l => l.startsWith(`${name}{`) && l.includes(labels))
    return line === undefined ? 0 : Number(line.split(' ').pop())
  }

  it('a pull that lands: counted ok, its bytes in, its rate learned for that peer only', async () => {
    const { registry, metrics, links } = setup()
    const got = await runPull({ peerId: 'P', plan, links, signal: AbortSignal.timeout(5_000), metrics: { metrics, model: 'm' }, pull: async () => ({ ok: true, tokens: 2000, bytes: 1_000_000, ms: 10 }) })
    expect(got).toMatchObject({ ok: true, tokens: 2000 })
    expect(await value(registry, 'shoal_kv_pulls_total', 'outcome="ok"')).toBe(1)
    expect(await value(registry, 'shoal_kv_transfer_bytes_total', 'direction="in"')).toBe(1_000_000)
    expect(links.estimate('P')).toEqual({ bytesPerSecond: 100_000_000, measured: true })
    expect(links.estimate('Q').measured).toBe(false)
  })

  it('a refusal or a throw is a fallback that teaches nothing of the link', async () => {
    const { registry, metrics, links } = setup()
    const refused = await runPull({ peerId: 'P', plan, links, signal: AbortSignal.timeout(5_000), metrics: { metrics, model: 'm' }, pull: async () => ({ ok: false, code: 'SHOAL_ERR_KV_REFUSED', reason: 'no' }) })
    expect(refused).toMatchObject({ ok: false, code: 'SHOAL_ERR_KV_REFUSED' })
    const thrown = await runPull({ peerId: 'P', plan, links, signal: AbortSignal.timeout(5_000), metrics: { metrics, model: 'm' }, pull: async () => { throw Object.assign(new Error('boom'), { code: 'SHOAL_ERR_KV_CHECKSUM' }) } })
    expect(thrown).toMatchObject({ ok: false, code: 'SHOAL_ERR_KV_CHECKSUM' })
    expect(await value(registry, 'shoal_kv_pulls_total', 'outcome="fallback"')).toBe(2)
    expect(await value(registry, 'shoal_kv_transfer_bytes_total', 'direction="in"')).toBe(0)
    expect(links.estimate('P').measured).toBe(false)
  })

  it('a pull past its bound is given up, and bounds the link\'s estimate', async () => {
    const { links } = setup()
    const short = { ...plan, waitMs: 20 }
    const got = await runPull({
      peerId: 'P', plan: short, links, signal: AbortSignal.timeout(5_000),
      pull: async (signal) => await new Promise<PullOutcome>((resolve) => { signal.addEventListener('abort', () => { resolve({ ok: false, code: 'SHOAL_ERR_KV_TIMEOUT', reason: 'late' }) }) }),
    })
    expect(got).toMatchObject({ ok: false, code: 'SHOAL_ERR_KV_TIMEOUT' })
    const e = links.estimate('P')
    expect(e.measured).toBe(true)
    // At most the whole gain over the time it had.
    expect(e.bytesPerSecond).toBeLessThanOrEqual(2000 * 8192 / 0.02)
  })

  it('the request\'s own abort is not a pull failure: it throws', async () => {
    const { links } = setup()
    const ctl = new AbortController()
    const p = runPull({ peerId: 'P', plan, links, signal: ctl.signal, pull: async (signal) => await new Promise<PullOutcome>((_resolve, reject) => { signal.addEventListener('abort', () => { reject(signal.reason) }) }) })
    ctl.abort(new Error('client went away'))
    await expect(p).rejects.toThrow('client went away')
  })
})
