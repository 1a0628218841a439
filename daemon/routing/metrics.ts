/**
 * Routing's own Prometheus metrics, in the registry the daemon passes (one /metrics page);
 * registering twice on one registry reuses the metric.
 */
import { Counter, type Registry } from 'prom-client'

export interface RoutingMetrics {
  /**
   * Requests routed while some candidate kept prefixes, by where they went: to a node holding part
   * of the prompt ('holder'), to one that does not while another does ('elsewhere': the request
   * carries that peer as its prefixHolder hint), or where nobody holds any of it ('none').
   */
  prefixRoutes: Counter<'outcome'>
}

export function createRoutingMetrics (registry?: Registry): RoutingMetrics {
  const name = 'shoal_routing_prefix_requests_total'
  const existing = registry?.getSingleMetric(name) as Counter<'outcome'> | undefined
  return {
    prefixRoutes: existing ?? new Counter({
      name,
      help: 'Requests routed while candidates kept prefixes: to a holder of the prompt\'s prefix, elsewhere while a peer held it, or with no holder',
      labelNames: ['outcome'],
      registers: registry === undefined ? [] : [registry],
    }),
  }
}
