/**
 * Draining (an operator's maintenance): the node's load replies say `accepting: false`, so peers
 * route no new requests to it and form new chains around it, while what runs finishes and its kept
 * KV prefixes stay pullable. Pure functions; the daemon holds the flag.
 */
import type { LoadRecord } from '../mesh/index.ts'
import type { Candidate } from '../routing/index.ts'

/** A load reply as a draining node sends it (unchanged when not draining). */
export function drainedLoad (load: LoadRecord, draining: boolean): LoadRecord {
  return draining ? { ...load, accepting: false } : load
}

/**
 * The candidates a draining node's own ingress routes over: its own entry says not accepting
 * (it sends requests elsewhere), unless no other candidate can take the request — alive, whole
 * model, and not itself refusing — in which case it still serves them itself rather than 503.
 */
export function lastResortLocal (candidates: readonly Candidate[]): Candidate[] {
  const others = candidates.some(c => !c.local && c.alive && c.wholeModel && c.load?.accepting !== false)
  if (others) return [...candidates]
  return candidates.map(c => {
    if (!c.local || c.load?.accepting !== false) return c
    const { accepting: _, ...load } = c.load
    return { ...c, load }
  })
}
