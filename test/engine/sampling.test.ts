import { describe, expect, it } from 'vitest'
import fc from 'fast-check'
import { argmax, createRng, greedyVerdict, nucleus, pickToken, sampleToken } from '../../daemon/engine/index.ts'
import { greedyVerdictOfTokens } from '../../daemon/engine/verdict.ts'

/** The plain definitions the fast sampler must agree with: one compare-and-remember loop, and a full sort. */
/** TopK k = 1's scan: from index 0, moving only to a larger value. */
function referenceArgmax (logits: Float32Array, offset = 0, length = logits.length - offset): number {
  let best = 0
  let bestValue = logits[offset]!
  for (let i = 1; i < length; i++) {
    const v = logits[offset + i]!
    if (v > bestValue) { bestValue = v; best = i }
  }
  return best
}

/** Kept ids (sorted by id) of the smallest most-likely prefix reaching topP, the prefix mass before and after the last kept token, and whether that token nearly ties the next. */
function referenceNucleus (logits: Float32Array, temperature: number, topP: number): { ids: number[], before: number, after: number, nearTie: boolean } {
  const p = Array.from(logits, l => l / temperature)
  const max = Math.max(...p)
  const e = p.map(z => Math.exp(z - max))
  const sum = e.reduce((a, b) => a + b, 0)
  // p = 1 keeps every token with any probability (a running sum can reach 1 before the last ones).
  if (topP >= 1) return { ids: e.flatMap((w, i) => w > 0 ? [i] : []), before: 0, after: 0, nearTie: false }
  const order = e.map((_, i) => i).sort((a, b) => (e[b]! - e[a]!) || (a - b))
  const ids: number[] = []
  let mass = 0
  let before = 0
  for (const i of order) {
    before = mass
    ids.push(i)
    mass += e[i]! / sum
    if (mass >= topP) break
  }
  // The last kept and the first dropped token within rounding of each other: which one goes is
  // decided by rounding (logits that differ by 1e-17, or l / T against l · (1 / T)).
  const last = e[ids.at(-1)!]!
  const next = order[ids.length] === undefined ? -1 : e[order[ids.length]!]!
  return { ids: ids.sort((a, b) => a - b), before, after: mass, nearTie: Math.abs(last - next) <= 1e-12 * last }
}

describe('sampling', () => {
  it('greedy picks the argmax; ties go to the lowest id', () => {
    expect(argmax(Float32Array.of(1, 3, 2, 3))).toBe(1)
    expect(argmax(Float32Array.of(-5, -5, -5))).toBe(0)
    expect(argmax(Float32Array.of(2, NaN, 1, NaN))).toBe(0) // a NaN never takes over…
    expect(argmax(Float32Array.of(-Infinity, NaN, 1))).toBe(2)
    expect(argmax(Float32Array.of(NaN, 1, NaN))).toBe(0) // …and one at index 0 is kept, as TopK keeps it
    expect(argmax(Float32Array.of(7, NaN, 1, 9), 1, 3)).toBe(0) // index 0 of the row, not of the array
    // over a row of a [K, V] block
    expect(argmax(Float32Array.of(9, 9, 0, 1, 1), 2, 3)).toBe(1)
    expect(sampleToken(Float32Array.of(0, 7, 7), { temperature: 0, topP: 0.1 }, () => 0.99)).toBe(1)
  })

  it('a greedy verdict from each row\'s argmax equals the one from the rows\' logits', () => {
    const V = 7
    const rng = createRng(11)
    for (let trial = 0; trial < 200; trial++) {
      const n = 1 + Math.floor(rng() * 6)
      const logits = Float32Array.from({ length: (n + 1) * V }, () => Math.floor(rng() * 4)) // ties often
      const best = Array.from({ length: n + 1 }, (_, i) => argmax(logits, i * V, V))
      // Drafts right for a random prefix, then (mostly) wrong.
      const good = Math.floor(rng() * (n + 1))
      const drafts = best.slice(0, n).map((t, i) => i < good ? t : (t + 1 + Math.floor(rng() * 2)) % V)
      const want = greedyVerdict(drafts, logits, V)
      expect(greedyVerdictOfTokens(drafts, best)).toEqual(want)
      expect(want.accepted).toBeGreaterThanOrEqual(good)
      expect(want.next).toBe(best[want.accepted])
    }
    expect(() => greedyVerdictOfTokens([1, 2], [1])).toThrow(RangeError)
  })

  it('property: argmax is TopK\'s pick (the first index of the largest value; a NaN at index 0 kept), whatever the row and its offset', () => {
    fc.assert(fc.property(
      fc.array(fc.oneof(fc.float({ noNaN: false }), fc.constantFrom(1, 1, -Infinity, NaN)), { minLength: 1, maxLength: 70 }),
      fc.nat(), fc.nat(),
      (values, a, b) => {
        const logits = Float32Array.from(values)
        const offset = a % logits.length
        const length = 1 + (b % (logits.length - offset))
        expect(argmax(logits, offset, length)).toBe(referenceArgmax(logits, offset, length))
      },
    ), { numRuns: 500 })
  })

  it('the same seed gives the same tokens; different seeds differ', () => {
    const logits = Float32Array.from({ length: 64 }, (_, i) => Math.sin(i) * 2)
    const draw = (seed: number): number[] => {
      const rng = createRng(seed)
      return Array.from({ length: 50 }, () => sampleToken(logits, { temperature: 1, topP: 0.95 }, rng))
    }
    expect(draw(42)).toEqual(draw(42))
    expect(draw(42)).not.toEqual(draw(43))
    // Pinned Mulberry32 outputs: a seed must reproduce across versions and machines.
    const rng = createRng(1)
    expect([rng(), rng(), rng()]).toEqual([0.6270739405881613, 0.002735721180215478, 0.5274470399599522])
  })

  it('rng is uniform enough in [0, 1)', () => {
    const rng = createRng(7)
    const buckets = new Array<number>(10).fill(0)
    for (let i = 0; i < 20000; i++) {
      const u = rng()
      expect(u).toBeGreaterThanOrEqual(0)
      expect(u).toBeLessThan(1)
      buckets[Math.floor(u * 10)]!++
    }
    for (const b of buckets) expect(Math.abs(b - 2000)).toBeLessThan(200)
  })

  it('top-p keeps the smallest high-probability prefix reaching p', () => {
    // probabilities 0.5, 0.25, 0.125, 0.125 (logits = log p)
    const logits = Float32Array.from([0.5, 0.25, 0.125, 0.125].map(Math.log))
    expect([...nucleus(logits, { temperature: 1, topP: 0.5 }).ids]).toEqual([0])
    expect([...nucleus(logits, { temperature: 1, topP: 0.6 }).ids]).toEqual([0, 1])
    expect([...nucleus(logits, { temperature: 1, topP: 0.8 }).ids]).toEqual([0, 1, 2]) // tie 2/3 → lower id first
    const all = nucleus(logits, { temperature: 1, topP: 1 })
    expect([...all.ids]).toEqual([0, 1, 2, 3])
    expect(all.probs[0]).toBeCloseTo(0.5, 6)
  })

  it('property: sampled tokens come from the nucleus, whose mass reaches p and is renormalised', () => {
    fc.assert(fc.property(
      fc.array(fc.float({ min: -10, max: 10, noNaN: true }), { minLength: 1, maxLength: 40 }),
      fc.double({ min: 0.05, max: 1, noNaN: true }),
      fc.double({ min: 0.2, max: 2, noNaN: true }),
      fc.integer(),
      (values, topP, temperature, seed) => {
        const logits = Float32Array.from(values)
        const { ids, probs } = nucleus(logits, { temperature, topP })
        const sum = probs.reduce((a, b) => a + b, 0)
        expect(sum).toBeCloseTo(1, 9)
        // every kept token is at least as likely as every dropped one
        const kept = new Set(ids)
        const minKept = Math.min(...[...ids].map(i => logits[i]!))
        for (let i = 0; i < logits.length; i++) if (!kept.has(i)) expect(logits[i]!).toBeLessThanOrEqual(minKept + 1e-6) // equal probabilities tie by id
        const rng = createRng(seed)
        for (let k = 0; k < 5; k++) expect(kept.has(sampleToken(logits, { temperature, topP }, rng))).toBe(true)
      },
    ), { numRuns: 200 })
  })

  it('property: the nucleus is the sorted definition\'s, without sorting (ties by lower id)', () => {
    fc.assert(fc.property(
      fc.array(fc.oneof(fc.float({ min: -10, max: 10, noNaN: true }), fc.constantFrom(0, 0, 1)), { minLength: 1, maxLength: 600 }),
      fc.double({ min: 0.01, max: 1, noNaN: true }),
      fc.double({ min: 0.2, max: 2, noNaN: true }),
      (values, topP, temperature) => {
        const logits = Float32Array.from(values)
        const ref = referenceNucleus(logits, temperature, topP)
        const got = nucleus(logits, { temperature, topP })
        // Sums in another order may round across p only where the reference's prefix mass is within rounding of it.
        if (Math.abs(ref.before - topP) > 1e-9 && Math.abs(ref.after - topP) > 1e-9 && !ref.nearTie) expect([...got.ids]).toEqual(ref.ids)
      },
    ), { numRuns: 300 })
  })

  it('a 32k vocabulary: the cut through many log-probability buckets equals the sorted one', () => {
    const rng = createRng(5)
    const peaked = Float32Array.from({ length: 32000 }, () => (rng() * 2 - 1) * 12)
    const flat = Float32Array.from({ length: 32000 }, () => rng() * 0.001)
    const same = new Float32Array(32000).fill(0.25)
    for (const [logits, temperature, topP] of [[peaked, 0.7, 0.9], [peaked, 1, 0.5], [flat, 1, 0.95], [flat, 0.5, 0.3]] as const) {
      const ref = referenceNucleus(logits, temperature, topP)
      expect([...nucleus(logits, { temperature, topP }).ids]).toEqual(ref.ids)
    }
    // All equal: the lower half of the ids, exactly (the normalised running sum of the sorted
    // definition rounds just short of 0.5 at 16,000 and keeps one more).
    expect(nucleus(same, { temperature: 1, topP: 0.5 }).ids.length).toBe(16000)
    expect(nucleus(same, { temperature: 1, topP: 0.5 }).ids[15999]).toBe(15999)
    // top-p 1 keeps every token that has any probability.
    expect(nucleus(peaked, { temperature: 1, topP: 1 }).ids.length).toBe(32000)
  })

  it('with top-p < 1, a draw is a function of u and always a kept token', () => {
    const logits = Float32Array.from([0.1, 0.6, 0.05, 0.25].map(Math.log))
    // top-p 0.8 keeps 0.6 + 0.25 (ids 1 and 3).
    const u = createRng(4)
    const seen = new Set<number>()
    for (let d = 0; d < 500; d++) {
      const x = u()
      const id = pickToken(logits, { temperature: 1, topP: 0.8, u: x })
      expect(pickToken(logits, { temperature: 1, topP: 0.8, u: x })).toBe(id)
      seen.add(id)
    }
    expect([...seen].sort()).toEqual([1, 3])
    // Below the rejection draw's top-p floor (0.25) the walk decides: still the nucleus (id 1 alone).
    expect(pickToken(logits, { temperature: 1, topP: 0.1, u: 0.99 })).toBe(1)
  })

  it('with top-p < 1 the draws follow the renormalised nucleus exactly (chi-square over 2,000 tokens, cuts through many cells)', () => {
    const rng = createRng(23)
    const logits = Float32Array.from({ length: 2000 }, (_, i) => i === 5 ? 4 : (rng() * 2 - 1) * 8)
    logits[17] = -Infinity
    for (const [temperature, topP] of [[1, 0.9], [0.6, 0.5], [1.5, 0.3]] as const) {
      const { ids, probs } = nucleus(logits, { temperature, topP })
      const prob = new Float64Array(2000)
      ids.forEach((id, k) => { prob[id] = probs[k]! })
      // Ten bins of about equal probability, by id order.
      const bin = new Int32Array(2000).fill(-1)
      let acc = 0
      prob.forEach((q, i) => { if (q > 0) { bin[i] = Math.min(9, Math.floor(acc * 10)); acc += q } })
      const expected = new Float64Array(10)
      prob.forEach((q, i) => { if (q > 0) expected[bin[i]!] = expected[bin[i]!]! + q })
      const draws = 20000
      const seen = new Float64Array(10)
      const u = createRng(6)
      for (let d = 0; d < draws; d++) {
        const id = pickToken(logits, { temperature, topP, u: u() })
        expect(prob[id]).toBeGreaterThan(0) // a kept token, every time
        seen[bin[id]!]!++
      }
      let chi = 0
      for (let b = 0; b < 10; b++) if (expected[b]! > 0) chi += (seen[b]! - expected[b]! * draws) ** 2 / (expected[b]! * draws)
      expect(chi).toBeLessThan(30) // 9 degrees of freedom: p ≈ 0.0004
    }
  })

  it('with top-p < 1 on a 32k vocabulary, the draws stay in the nucleus, equal weights included', () => {
    const rng = createRng(7)
    const peaked = Float32Array.from({ length: 32000 }, () => (rng() * 2 - 1) * 12)
    const same = new Float32Array(32000).fill(0.25)
    const u = createRng(8)
    for (const [logits, temperature, topP] of [[peaked, 0.7, 0.9], [peaked, 1, 0.5], [same, 1, 0.5], [same, 0.8, 0.95]] as const) {
      const kept = new Set(nucleus(logits, { temperature, topP }).ids)
      for (let d = 0; d < 200; d++) expect(kept.has(pickToken(logits, { temperature, topP, u: u() }))).toBe(true)
    }
  })

  it('property: with top-p < 1 a row read at an offset draws what its copy at 0 draws, a kept token (NaN: the argmax, as the walk decides)', () => {
    fc.assert(fc.property(
      fc.array(fc.oneof(fc.double({ min: -6, max: 6, noNaN: true }), fc.constant(-Infinity), fc.constant(Number.NaN)), { minLength: 2, maxLength: 300 }),
      fc.nat(), fc.nat(), fc.double({ min: 0, max: 0.999999, noNaN: true }), fc.double({ min: 0.2, max: 3, noNaN: true }), fc.double({ min: 0.05, max: 0.999, noNaN: true }),
      (values, a, b, u, temperature, topP) => {
        const logits = Float32Array.from(values)
        const offset = a % logits.length
        const length = 1 + (b % (logits.length - offset))
        const row = logits.slice(offset, offset + length)
        const pick = { temperature, topP, u }
        const got = pickToken(logits, pick, offset, length)
        expect(got).toBe(pickToken(row, pick))
        if (row.some(Number.isNaN) || !row.some(x => x > -Infinity)) expect(got).toBe(argmax(row))
        else expect([...nucleus(row, { temperature, topP }).ids]).toContain(got)
      }), { numRuns: 500 })
  })

  it('over the whole vocabulary a draw is a function of u, and the draws follow softmax exactly (chi-square over 2,000 tokens)', () => {
    const rng = createRng(21)
    // 2,000 logits over ~40 nats: many rejection cells, and some tokens past the last one.
    const logits = Float32Array.from({ length: 2000 }, (_, i) => i === 7 ? 6 : (rng() * 2 - 1) * 20)
    logits[11] = -Infinity
    logits[13] = NaN
    for (const temperature of [1, 0.6]) {
      const z = Array.from(logits, l => Number.isNaN(l) ? -Infinity : l / temperature)
      const max = Math.max(...z)
      const e = z.map(v => Math.exp(v - max))
      const sum = e.reduce((a, b) => a + b, 0)
      // Ten bins of about equal probability, by id order.
      const bin = new Int32Array(2000)
      let acc = 0
      e.forEach((w, i) => { bin[i] = Math.min(9, Math.floor(acc / sum * 10)); acc += w })
      const expected = new Float64Array(10)
      e.forEach((w, i) => { const b = bin[i]!; expected[b] = expected[b]! + w / sum })
      const draws = 20000
      const seen = new Float64Array(10)
      const u = createRng(5)
      for (let d = 0; d < draws; d++) {
        const x = u()
        const id = pickToken(logits, { temperature, topP: 1, u: x })
        expect(id).not.toBe(11)
        expect(id).not.toBe(13)
        if (d < 50) expect(pickToken(logits, { temperature, topP: 1, u: x })).toBe(id)
        seen[bin[id]!]!++
      }
      let chi = 0
      for (let b = 0; b < 10; b++) if (expected[b]! > 0) chi += (seen[b]! - expected[b]! * draws) ** 2 / (expected[b]! * draws)
      expect(chi).toBeLessThan(30) // 9 degrees of freedom: p ≈ 0.0004
    }
  })

  it('over the whole vocabulary: two tokens in one rejection cell keep their exact odds', () => {
    // Both within the top cell (1/16 nat wide): proposed equally, so only the acceptance test
    // makes token 0 more likely — e^0.06 / (1 + e^0.06) = 0.51500 (always accepting would give 0.5).
    const logits = Float32Array.of(0, -0.06)
    const u = createRng(9)
    let zeros = 0
    for (let d = 0; d < 100000; d++) if (pickToken(logits, { temperature: 1, topP: 1, u: u() }) === 0) zeros++
    expect(Math.abs(zeros / 100000 - 1 / (1 + Math.exp(-0.06)))).toBeLessThan(0.005)
  })

  it('property: over the whole vocabulary a row read at an offset draws what its copy at 0 draws (−∞ and NaN among them)', () => {
    // The draw names a cell's member by scanning the row from its end: a window inside a larger
    // array (the batch's logits) must give the same member as the window alone, for every u.
    fc.assert(fc.property(
      fc.array(fc.oneof(fc.double({ min: -6, max: 6, noNaN: true }), fc.constant(-Infinity), fc.constant(Number.NaN)), { minLength: 2, maxLength: 300 }),
      fc.nat(), fc.nat(), fc.double({ min: 0, max: 0.999999, noNaN: true }), fc.double({ min: 0.2, max: 3, noNaN: true }),
      (values, a, b, u, temperature) => {
        const logits = Float32Array.from(values)
        const offset = a % logits.length
        const length = 1 + (b % (logits.length - offset))
        const pick = { temperature, topP: 1, u }
        const got = pickToken(logits, pick, offset, length)
        expect(got).toBe(pickToken(logits.slice(offset, offset + length), pick))
        expect(got).toBeGreaterThanOrEqual(0)
        expect(got).toBeLessThan(length)
      }), { numRuns: 500 })
  })

  it('over the whole vocabulary: nothing finite gives the argmax; a +∞ logit wins', () => {
    expect(pickToken(Float32Array.of(-Infinity, NaN, -Infinity), { temperature: 1, topP: 1, u: 0.5 })).toBe(0)
    expect(pickToken(Float32Array.of(0, Infinity, 3), { temperature: 1, topP: 1, u: 0.5 })).toBe(1)
    expect(pickToken(Float32Array.of(0, 1e-3, -5), { temperature: 1e-9, topP: 1, u: 0.99 })).toBe(1)
  })

  it('top-p sampling follows the renormalised nucleus', () => {
    const logits = Float32Array.from([0.5, 0.3, 0.15, 0.05].map(Math.log))
    const rng = createRng(11)
    const counts = [0, 0, 0, 0]
    for (let i = 0; i < 20000; i++) counts[sampleToken(logits, { temperature: 1, topP: 0.9 }, rng)]!++
    expect(counts[3]).toBe(0)
    expect(counts[0]! / 20000).toBeCloseTo(0.5 / 0.95, 1)
    expect(counts[2]! / 20000).toBeCloseTo(0.15 / 0.95, 1)
  })

  it('temperature sampling follows the distribution', () => {
    const logits = Float32Array.from([0.7, 0.2, 0.1].map(Math.log))
    const rng = createRng(3)
    const counts = [0, 0, 0]
    for (let i = 0; i < 10000; i++) counts[sampleToken(logits, { temperature: 1, topP: 1 }, rng)]!++
    expect(counts[0]! / 10000).toBeCloseTo(0.7, 1)
    expect(counts[2]! / 10000).toBeCloseTo(0.1, 1)
  })
})
