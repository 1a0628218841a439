/**
 * A small deterministic PRNG (splitmix32 seeding xoshiro128**) with Gaussian samples, so test
 * checkpoints are identical on every machine and Node version.
 */
export class Prng {
  private s0: number
  private s1: number
  private s2: number
  private s3: number
  private spare: number | undefined

  constructor (seed: number) {
    let x = seed >>> 0
    const next = (): number => {
      x = (x + 0x9e3779b9) >>> 0
      let z = x
      z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0
      z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0
      return (z ^ (z >>> 16)) >>> 0
    }
    this.s0 = next(); this.s1 = next(); this.s2 = next(); this.s3 = next()
  }

  /** Uniform 32-bit unsigned integer. */
  u32 (): number {
    const r = Math.imul(rotl(Math.imul(this.s1, 5), 7), 9) >>> 0
    const t = this.s1 << 9
    this.s2 ^= this.s0; this.s3 ^= this.s1; this.s1 ^= this.s2; this.s0 ^= this.s3
    this.s2 ^= t
    this.s3 = rotl(this.s3, 11)
    return r
  }

  /** Uniform in (0, 1). */
  uniform (): number {
    return (this.u32() + 0.5) / 4294967296
  }

  /** Standard normal (Box–Muller, pairs cached). */
  normal (): number {
    if (this.spare !== undefined) { const v = this.spare; this.spare = undefined; return v }
    const r = Math.sqrt(-2 * Math.log(this.uniform()))
    const a = 2 * Math.PI * this.uniform()
    this.spare = r * Math.sin(a)
    return r * Math.cos(a)
  }
}

function rotl (x: number, k: number): number {
  return ((x << k) | (x >>> (32 - k))) >>> 0
}

/** A stable 32-bit hash of a string (FNV-1a), to derive one stream per tensor name. */
export function hash32 (s: string): number {
  let h = 0x811c9dc5
  for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 0x01000193) >>> 0
  return h
}
