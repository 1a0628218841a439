/**
 * The batcher's Prometheus metrics, labelled by batcher (one per engine session). They go in the
 * registry the daemon passes (one `/metrics` page); without one they still count, unregistered.
 * Registering twice on one registry reuses the metric.
 */
import { Counter, Gauge, Histogram, type Registry } from 'prom-client'
import type { BatchLimits } from './types.ts'

export interface BatcherMetrics {
  batchSize: Histogram<'batcher'>
  batchTokens: Histogram<'batcher'>
  queueDelay: Histogram<'batcher' | 'kind'>
  stepTime: Histogram<'batcher'>
  refused: Counter<'batcher' | 'reason'>
  /** Decode steps whose token the engine had computed ahead (no run of their own). */
  ranAhead: Counter<'batcher'>
  queueDepth: Gauge<'batcher'>
  expectedWait: Gauge<'batcher'>
  /** The configured bounds, so dashboards show the batching delay apart from other deadlines. */
  config: Gauge<'batcher' | 'setting'>
}

export function createBatcherMetrics (registry?: Registry): BatcherMetrics {
  const registers = registry === undefined ? [] : [registry]
  const reuse = <T>(name: string, make: () => T): T => (registry?.getSingleMetric(name) as T | undefined) ?? make()
  return {
    batchSize: reuse('shoal_batch_size', () => new Histogram({
      name: 'shoal_batch_size', help: 'Sequences per batched run', labelNames: ['batcher'], registers,
      buckets: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64],
    })),
    batchTokens: reuse('shoal_batch_tokens', () => new Histogram({
      name: 'shoal_batch_tokens', help: 'Positions per batched run', labelNames: ['batcher'], registers,
      buckets: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048],
    })),
    queueDelay: reuse('shoal_batch_queue_delay_seconds', () => new Histogram({
      name: 'shoal_batch_queue_delay_seconds', help: 'From a step (or its next chunk) being ready to its run starting', labelNames: ['batcher', 'kind'], registers,
      buckets: [0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5],
    })),
    stepTime: reuse('shoal_batch_step_seconds', () => new Histogram({
      name: 'shoal_batch_step_seconds', help: 'Time of one batched executor run', labelNames: ['batcher'], registers,
      buckets: [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5],
    })),
    refused: reuse('shoal_batch_refused_total', () => new Counter({
      name: 'shoal_batch_refused_total', help: 'Steps refused at submit (overloaded: over the wait budget; queue_full: over maxQueue)', labelNames: ['batcher', 'reason'], registers,
    })),
    ranAhead: reuse('shoal_batch_steps_ahead_total', () => new Counter({
      name: 'shoal_batch_steps_ahead_total', help: 'Decode steps whose token the engine worker had already computed running ahead (no run of their own)', labelNames: ['batcher'], registers,
    })),
    queueDepth: reuse('shoal_batch_queue_depth', () => new Gauge({
      name: 'shoal_batch_queue_depth', help: 'Steps waiting for a batched run', labelNames: ['batcher'], registers,
    })),
    expectedWait: reuse('shoal_batch_expected_wait_seconds', () => new Gauge({
      name: 'shoal_batch_expected_wait_seconds', help: 'What a new prefill would wait before its run starts', labelNames: ['batcher'], registers,
    })),
    config: reuse('shoal_batch_config', () => new Gauge({
      name: 'shoal_batch_config', help: 'Batcher bounds: max_batch, max_positions, max_queue_delay_seconds, budget_seconds', labelNames: ['batcher', 'setting'], registers,
    })),
  }
}

export function recordConfig (m: BatcherMetrics, batcher: string, limits: BatchLimits, budgetMs: number): void {
  m.config.set({ batcher, setting: 'max_batch' }, limits.maxBatch)
  m.config.set({ batcher, setting: 'max_positions' }, limits.maxPositions)
  m.config.set({ batcher, setting: 'max_queue_delay_seconds' }, limits.maxQueueDelayMs / 1000)
  m.config.set({ batcher, setting: 'budget_seconds' }, budgetMs / 1000)
}
