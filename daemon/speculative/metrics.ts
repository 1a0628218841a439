/**
 * Speculative decoding on /metrics: tokens drafted and accepted, rounds, the K each round used,
 * and drafters given up on, labelled by model and drafter. Registering twice on one registry
 * reuses the metric.
 */
import { Counter, Histogram, type Registry } from 'prom-client'

export interface SpeculationMetrics {
  drafted: Counter<'model' | 'drafter'>
  accepted: Counter<'model' | 'drafter'>
  rounds: Counter<'model' | 'drafter'>
  k: Histogram<'model' | 'drafter'>
  failures: Counter<'model' | 'drafter'>
}

export function createSpeculationMetrics (registry?: Registry): SpeculationMetrics {
  const registers = registry === undefined ? [] : [registry]
  const reuse = <T>(name: string, make: () => T): T => (registry?.getSingleMetric(name) as T | undefined) ?? make()
  const labelNames = ['model', 'drafter'] as const
  return {
    drafted: reuse('shoal_speculative_drafted_tokens_total', () => new Counter({ name: 'shoal_speculative_drafted_tokens_total', help: 'Draft tokens sent to verification', labelNames, registers })),
    accepted: reuse('shoal_speculative_accepted_tokens_total', () => new Counter({ name: 'shoal_speculative_accepted_tokens_total', help: 'Draft tokens the target accepted', labelNames, registers })),
    rounds: reuse('shoal_speculative_rounds_total', () => new Counter({ name: 'shoal_speculative_rounds_total', help: 'Verification steps (K + 1 positions each)', labelNames, registers })),
    k: reuse('shoal_speculative_k', () => new Histogram({ name: 'shoal_speculative_k', help: 'Tokens drafted per round (K)', labelNames, registers, buckets: [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16] })),
    failures: reuse('shoal_speculative_drafter_failures_total', () => new Counter({ name: 'shoal_speculative_drafter_failures_total', help: 'Sequences whose drafter failed (they went on with plain decoding)', labelNames, registers })),
  }
}
