/**
 * The ingress's Prometheus metrics. They live in a registry the caller may pass, so other modules
 * add theirs to the same `/metrics` page; registering twice on one registry reuses the metric.
 */
import { Counter, Gauge, Histogram, type Registry } from 'prom-client'

export interface IngressMetrics {
  requests: Counter<'method' | 'route' | 'status'>
  inFlight: Gauge<'route'>
  timeToFirstToken: Histogram<'model'>
  interToken: Histogram<'model'>
  tokensGenerated: Counter<'model'>
  promptTokens: Counter<'model'>
}

function reuse<T> (registry: Registry, name: string, make: () => T): T {
  return (registry.getSingleMetric(name) as T | undefined) ?? make()
}

export function createIngressMetrics (registry: Registry): IngressMetrics {
  const registers = [registry]
  return {
    requests: reuse(registry, 'shoal_http_requests_total', () => new Counter({
      name: 'shoal_http_requests_total', help: 'HTTP requests answered, by route and status', labelNames: ['method', 'route', 'status'], registers,
    })),
    inFlight: reuse(registry, 'shoal_http_requests_in_flight', () => new Gauge({
      name: 'shoal_http_requests_in_flight', help: 'HTTP requests being answered now', labelNames: ['route'], registers,
    })),
    timeToFirstToken: reuse(registry, 'shoal_time_to_first_token_seconds', () => new Histogram({
      name: 'shoal_time_to_first_token_seconds', help: 'From request to the first generated token', labelNames: ['model'], registers,
      buckets: [0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
    })),
    interToken: reuse(registry, 'shoal_inter_token_seconds', () => new Histogram({
      name: 'shoal_inter_token_seconds', help: 'Time between generated tokens', labelNames: ['model'], registers,
      buckets: [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56],
    })),
    tokensGenerated: reuse(registry, 'shoal_tokens_generated_total', () => new Counter({
      name: 'shoal_tokens_generated_total', help: 'Completion tokens generated', labelNames: ['model'], registers,
    })),
    promptTokens: reuse(registry, 'shoal_prompt_tokens_total', () => new Counter({
      name: 'shoal_prompt_tokens_total', help: 'Prompt tokens processed', labelNames: ['model'], registers,
    })),
  }
}
