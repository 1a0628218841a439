/**
 * The benchmarks' shared summaries and prompts (reproduction/lib): each definition pinned, so
 * that the result files' numbers stay reproducible and no one merges two medians into one.
 */
import { describe, expect, it } from 'vitest'
import { floorRank, lcgTokens, lowerMedian, median, medianInterval, nearestRank, promptIds, upperMedian, upperMedianBy } from '../../reproduction/lib/index.ts'

describe('reproduction summaries', () => {
  const even = [40, 10, 30, 20]

  it('tells the three medians apart on an even count, agrees on an odd one', () => {
    expect(median(even)).toBe(25)
    expect(lowerMedian(even)).toBe(20)
    expect(upperMedian(even)).toBe(30)
    for (const f of [median, lowerMedian, upperMedian]) expect(f([3, 1, 2])).toBe(2)
    expect(even).toEqual([40, 10, 30, 20])
  })

  it('ranks: nearest rank s[⌈qn⌉−1], floor rank s[⌊qn⌋]', () => {
    const ten = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    expect(nearestRank(ten, 0.5)).toBe(5)
    expect(floorRank(ten, 0.5)).toBe(6)
    expect(nearestRank(ten, 0.99)).toBe(10)
    expect(floorRank(ten, 0.99)).toBe(10)
    expect(nearestRank(ten, 0.25)).toBe(3)
    expect(floorRank(ten, 0.25)).toBe(3)
    expect(floorRank(even, 0.5)).toBe(upperMedian(even))
  })

  it('bounds the median by order statistics at ≥ 95 % (binomial tables: n 6 → 1st and 6th, n 20 → 6th and 15th, n 40 → 14th and 27th)', () => {
    const ranks = (n: number): [number, number] => medianInterval(Array.from({ length: n }, (_, i) => n - i))
    expect(ranks(6)).toEqual([1, 6])
    expect(ranks(20)).toEqual([6, 15])
    expect(ranks(40)).toEqual([14, 27])
    expect(ranks(5)).toEqual([NaN, NaN])
    // Past 0.5 ** n's underflow (n ≈ 1,074): n/2 ∓ 1.96·√n/2, as the normal approximation has it.
    expect(ranks(2000)).toEqual([956, 1045])
  })

  it('gives NaN for no values', () => {
    for (const f of [median, lowerMedian, upperMedian]) expect(f([])).toBeNaN()
    expect(nearestRank([], 0.5)).toBeNaN()
    expect(floorRank([], 0.5)).toBeNaN()
    expect(upperMedianBy([], () => 0)).toBeUndefined()
  })

  it('picks the whole item at the upper middle key', () => {
    const runs = [{ tokS: 3, id: 'a' }, { tokS: 1, id: 'b' }, { tokS: 2, id: 'c' }, { tokS: 4, id: 'd' }]
    expect(upperMedianBy(runs, r => r.tokS)?.id).toBe('a')
  })
})

describe('reproduction prompts', () => {
  it('are the fixed ids earlier results were measured with', () => {
    expect(promptIds(4)).toEqual([3, 40, 77, 114])
    expect(promptIds(2, 5)).toEqual([8, 45])
    expect(lcgTokens(3, 1)).toEqual([142, 491, 243])
    expect(lcgTokens(3, 1)).toEqual(lcgTokens(3, 1, 500))
    const small = lcgTokens(200, 7, 64)
    expect(Math.min(...small)).toBeGreaterThanOrEqual(3)
    expect(Math.max(...small)).toBeLessThan(64)
  })
})

describe('parseQuant (the benchmarks\' --quants)', () => {
  it('takes none, its alias fp32, and int4, and refuses any other name', async () => {
    const { parseQuant } = await import('../../reproduction/lib/bench-models.ts')
    expect(parseQuant('none')).toBe('none')
    expect(parseQuant('fp32')).toBe('none')
    expect(parseQuant('int4')).toBe('int4')
    expect(() => parseQuant('q4_0')).toThrow(/unknown quant "q4_0"/)
    expect(() => parseQuant('')).toThrow(/unknown quant/)
  })
})
