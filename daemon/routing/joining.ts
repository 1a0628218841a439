/**
 * A node that has just started (or restarted) does not yet know every model its mesh serves:
 * peers' capability records reach it as they connect and republish (within the caps republish
 * interval, seconds to tens of seconds after it joins). A request for a model it has not heard of
 * in that window is not "no such model" (404, which a client must not retry) but "not known
 * here yet" (503, retry). Found by the chaos suite: a SIGKILLed ingress restarted on its data
 * directory answered 404 for the mesh's models for ~7 s after it was up again.
 */

/** Why an unknown model may only not be known yet, or undefined once the join window has passed. */
export function joiningReason (sinceStartMs: number, joinWindowMs: number): string | undefined {
  if (!(joinWindowMs > 0) || !(sinceStartMs < joinWindowMs)) return undefined
  return `this node joined the mesh ${(Math.max(0, sinceStartMs) / 1000).toFixed(1)} s ago and may not yet have heard from every peer (it waits up to ${Math.ceil(joinWindowMs / 1000)} s before calling a model unknown); retry shortly`
}
