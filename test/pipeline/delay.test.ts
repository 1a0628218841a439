/**
 * The simulated link (delay.ts): latency and a bandwidth cap. Only lower bounds on time are
 * checked (a loaded machine delivers late, never early), plus the order of delivery.
 */
import { describe, expect, it } from 'vitest'
import { createDelayLine } from '../../daemon/pipeline/delay.ts'

async function deliveries (pushes: Array<{ bytes: number }>, link: Parameters<typeof createDelayLine>[0]): Promise<number[]> {
  const line = createDelayLine(link)
  const t0 = performance.now()
  const at: number[] = []
  await new Promise<void>(resolve => {
    pushes.forEach(({ bytes }, i) => line.push(() => { at[i] = performance.now() - t0; if (at.filter(x => x !== undefined).length === pushes.length) resolve() }, bytes))
  })
  return at
}

describe('simulated link', () => {
  it('without latency or cap delivers at once', () => {
    let hit = false
    createDelayLine(0).push(() => { hit = true }, 1e9)
    expect(hit).toBe(true)
  })

  it('a bandwidth cap serialises frames: each arrives no sooner than the bytes before it allow', async () => {
    // 8 Mbit/s = 1000 bytes a millisecond: 20 kB frames take 20 ms each on the link.
    const at = await deliveries([{ bytes: 20_000 }, { bytes: 20_000 }, { bytes: 100 }], { mbps: 8 })
    expect(at[0]).toBeGreaterThanOrEqual(20 - 1)
    expect(at[1]).toBeGreaterThanOrEqual(40 - 1)
    expect(at[2]).toBeGreaterThanOrEqual(40.1 - 1)
    expect(at[0]! <= at[1]! && at[1]! <= at[2]!).toBe(true)
  })

  it('latency adds to the transfer time', async () => {
    const at = await deliveries([{ bytes: 10_000 }], { ms: 15, mbps: 8 })
    expect(at[0]).toBeGreaterThanOrEqual(25 - 1)
  })
})
