/**
 * The live load this node reports to the mesh: sequences in flight and recent decode throughput,
 * measured at the service boundary (every local generation passes through it).
 */
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'

export interface LoadReading {
  inFlight: number
  /** Exponentially weighted decode rate over all sequences, tokens per second. */
  decodeTokPerSec: number
  slots: number
}

export interface LoadMeter {
  service: InferenceService
  read: () => LoadReading
}

/** The rate decays with this time constant, so a burst shows quickly and fades within seconds. */
const RATE_TAU_MS = 2_000

export function meterLoad (inner: InferenceService, slots: number, now: () => number = Date.now): LoadMeter {
  let inFlight = 0
  let rate = 0
  let lastAt = now()
  let pending = 0
  const fold = (): void => {
    const t = now()
    const dt = Math.max(t - lastAt, 1)
    const alpha = 1 - Math.exp(-dt / RATE_TAU_MS)
    rate = rate + alpha * ((pending * 1000) / dt - rate)
    pending = 0
    lastAt = t
  }
  return {
    service: {
      models (): ModelCard[] { return inner.models() },
      async * generate (request: GenerateRequest, signal: AbortSignal): AsyncIterable<GenerateEvent> {
        inFlight++
        try {
          for await (const event of inner.generate(request, signal)) {
            if (event.type === 'delta') pending += event.tokenIds.length
            yield event
          }
        } finally {
          inFlight--
        }
      },
    },
    read () {
      fold()
      return { inFlight, decodeTokPerSec: rate, slots }
    },
  }
}
