/**
 * The prefix cache's Prometheus metrics, labelled by model. They go in the registry the daemon
 * passes (one `/metrics` page); registering twice on one registry reuses the metric.
 */
import { Counter, Gauge, type Registry } from 'prom-client'

export interface PrefixMetrics {
  /** Prompt tokens whose KV came from a kept prefix. */
  hitTokens: Counter<'model'>
  /** Prompt tokens prefilled (no kept prefix had them). */
  missTokens: Counter<'model'>
  /** Kept prefixes dropped to stay within the budget. */
  evictions: Counter<'model'>
  /** Bytes of KV kept now. */
  bytes: Gauge<'model'>
  /** KV bytes moved between nodes (/shoal/kv): `in` pulled and imported here, `out` served to a peer. */
  transferBytes: Counter<'model' | 'direction'>
  /** Pulls of a peer's prefix: `ok` (imported), `fallback` (refused, failed or invalid: recomputed). */
  pulls: Counter<'model' | 'outcome'>
}

export function createPrefixMetrics (registry?: Registry): PrefixMetrics {
  const registers = registry === undefined ? [] : [registry]
  const reuse = <T>(name: string, make: () => T): T => (registry?.getSingleMetric(name) as T | undefined) ?? make()
  return {
    hitTokens: reuse('shoal_kv_prefix_hit_tokens_total', () => new Counter({
      name: 'shoal_kv_prefix_hit_tokens_total', help: 'Prompt tokens whose KV came from a kept prefix (not prefilled)', labelNames: ['model'], registers,
    })),
    missTokens: reuse('shoal_kv_prefix_miss_tokens_total', () => new Counter({
      name: 'shoal_kv_prefix_miss_tokens_total', help: 'Prompt tokens prefilled because no kept prefix held them', labelNames: ['model'], registers,
    })),
    evictions: reuse('shoal_kv_prefix_evictions_total', () => new Counter({
      name: 'shoal_kv_prefix_evictions_total', help: 'Kept prefixes dropped to stay within --kv-cache-mb', labelNames: ['model'], registers,
    })),
    bytes: reuse('shoal_kv_prefix_bytes', () => new Gauge({
      name: 'shoal_kv_prefix_bytes', help: 'Bytes of KV kept for prefix reuse', labelNames: ['model'], registers,
    })),
    transferBytes: reuse('shoal_kv_transfer_bytes_total', () => new Counter({
      name: 'shoal_kv_transfer_bytes_total', help: 'KV bytes moved between nodes over /shoal/kv (in: pulled here, out: served)', labelNames: ['model', 'direction'], registers,
    })),
    pulls: reuse('shoal_kv_pulls_total', () => new Counter({
      name: 'shoal_kv_pulls_total', help: 'Pulls of a peer\'s prefix (ok: imported; fallback: refused, failed or invalid, recomputed)', labelNames: ['model', 'outcome'], registers,
    })),
  }
}
