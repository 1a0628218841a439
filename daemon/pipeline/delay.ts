/**
 * Simulated network latency for tests and benchmarks: a delay line that delivers each received
 * frame `ms` later than it arrived, in arrival order (one-way latency per hop; bandwidth is not
 * modelled). With 0 ms frames are delivered at once.
 */
export interface DelayLine {
  /** Runs `deliver` `ms` after now, never before anything pushed earlier. */
  push (deliver: () => void): void
  /** Drops what is still waiting. */
  clear (): void
}

export function createDelayLine (ms: number): DelayLine {
  if (!(ms > 0)) return { push: (deliver) => deliver(), clear: () => {} }
  const queue: Array<{ at: number, deliver: () => void }> = []
  let timer: ReturnType<typeof setTimeout> | undefined
  const pump = (): void => {
    timer = undefined
    const now = performance.now()
    while (queue.length > 0 && queue[0]!.at <= now + 0.5) queue.shift()!.deliver()
    if (queue.length > 0) timer = setTimeout(pump, queue[0]!.at - now)
  }
  return {
    push (deliver) {
      queue.push({ at: performance.now() + ms, deliver })
      timer ??= setTimeout(pump, ms)
    },
    clear () {
      queue.length = 0
      if (timer !== undefined) clearTimeout(timer)
      timer = undefined
    },
  }
}
