/**
 * Simulated network for tests and benchmarks: a delay line that delivers each received frame
 * `ms` later than it arrived (one-way latency per hop), in arrival order. With a bandwidth cap
 * (`mbps`, megabits per second) frames also queue for the node's incoming link: each occupies it
 * for bytes · 8 / (mbps · 10^6) seconds after the one before it is through, then the latency
 * applies — a frame of B bytes arrives no sooner than B / bandwidth after its predecessor. Without
 * either, frames are delivered at once.
 */
export interface DelayLine {
  /** Runs `deliver` after the frame's transfer (of `bytes`, with a cap) and the latency, never before anything pushed earlier. */
  push (deliver: () => void, bytes?: number): void
  /** Drops what is still waiting. */
  clear (): void
}

export interface SimulatedLink {
  /** One-way latency added to every frame. */
  ms?: number
  /** Incoming bandwidth cap, Mbit/s (10^6 bits). */
  mbps?: number
}

export function createDelayLine (link: number | SimulatedLink): DelayLine {
  const { ms = 0, mbps } = typeof link === 'number' ? { ms: link } : link
  const capped = mbps !== undefined && mbps > 0 && Number.isFinite(mbps)
  if (!(ms > 0) && !capped) return { push: (deliver) => deliver(), clear: () => {} }
  const msPerByte = capped ? 8 / (mbps * 1000) : 0
  const queue: Array<{ at: number, deliver: () => void }> = []
  let timer: ReturnType<typeof setTimeout> | undefined
  /** When the incoming link is free again (the last queued frame's transfer ends). */
  let linkFree = 0
  const pump = (): void => {
    timer = undefined
    const now = performance.now()
    while (queue.length > 0 && queue[0]!.at <= now + 0.5) queue.shift()!.deliver()
    if (queue.length > 0) timer = setTimeout(pump, queue[0]!.at - now)
  }
  return {
    push (deliver, bytes = 0) {
      const now = performance.now()
      linkFree = Math.max(now, linkFree) + bytes * msPerByte
      const at = linkFree + Math.max(0, ms)
      queue.push({ at, deliver })
      timer ??= setTimeout(pump, at - now)
    },
    clear () {
      queue.length = 0
      linkFree = 0
      if (timer !== undefined) clearTimeout(timer)
      timer = undefined
    },
  }
}
