/**
 * The mesh's decisions as pure functions over plain data: who is admitted, who is alive, which
 * record wins, when to redial. The code around them only gathers inputs and carries them out,
 * so every rule here is unit-tested without a socket.
 */

export type Liveness = 'alive' | 'suspect' | 'gone'

/** What one side concluded about the other's certificate (a certs `Admission`, reduced). */
export type Verification =
  | { admitted: true }
  | { admitted: false, reason: string, detail: string }

/** What the remote said about our certificate: nothing yet, accepted, or refused. */
export type RemoteVerdict =
  | { state: 'pending' }
  | { state: 'accepted' }
  | { state: 'refused', reason: string, detail: string }

export type AdmissionDecision =
  | { state: 'pending' }
  | { state: 'admitted' }
  | { state: 'refused', reason: string, detail: string, by: 'local' | 'remote' }

/**
 * Admission is mutual: a peer counts as admitted only when we verified its certificate AND it
 * accepted ours. Our own refusal wins over anything the remote says.
 */
export function decideAdmission (local: Verification | undefined, remote: RemoteVerdict): AdmissionDecision {
  if (local !== undefined && !local.admitted) return { state: 'refused', reason: local.reason, detail: local.detail, by: 'local' }
  if (remote.state === 'refused') return { state: 'refused', reason: `refused-by-peer:${remote.reason}`, detail: remote.detail, by: 'remote' }
  if (local?.admitted === true && remote.state === 'accepted') return { state: 'admitted' }
  return { state: 'pending' }
}

/**
 * Whether an admitted peer keeps its admission once the revocation list or the clock moves:
 * a revoked serial or a passed notAfter ends it at once.
 */
export function reviewAdmission (input: { serial: string, notAfterMs: number, revokedSerials: ReadonlySet<string> | readonly string[], now: number }): Verification {
  const revoked = Array.isArray(input.revokedSerials) ? input.revokedSerials.includes(input.serial) : (input.revokedSerials as ReadonlySet<string>).has(input.serial)
  if (revoked) return { admitted: false, reason: 'revoked', detail: `certificate ${input.serial} is on the revocation list` }
  if (input.now > input.notAfterMs) return { admitted: false, reason: 'expired', detail: `certificate ${input.serial} expired at ${new Date(input.notAfterMs).toISOString()}` }
  return { admitted: true }
}

/** Liveness from the last time the peer's load arrived. */
export function livenessState (input: { lastSeenMs: number, now: number, suspectAfterMs: number, goneAfterMs: number }): Liveness {
  const silent = input.now - input.lastSeenMs
  if (silent >= input.goneAfterMs) return 'gone'
  if (silent >= input.suspectAfterMs) return 'suspect'
  return 'alive'
}

export interface RecordHead {
  peerId: string
  seq: number
  issuedAt: number
}

export type RecordChoice = 'take' | 'stale' | 'future' | 'other-peer'

/**
 * Whether a candidate capability record replaces the one held: it must be about the same peer,
 * strictly newer by `seq`, and not issued further in the future than the allowed clock skew.
 */
export function chooseRecord (current: RecordHead | undefined, candidate: RecordHead, now: number, maxSkewMs: number): RecordChoice {
  if (current !== undefined && current.peerId !== candidate.peerId) return 'other-peer'
  if (candidate.issuedAt > now + maxSkewMs) return 'future'
  if (current !== undefined && candidate.seq <= current.seq) return 'stale'
  return 'take'
}

/** A record not refreshed within `ttlMs` is dropped. */
export function isRecordExpired (record: { receivedAt: number }, now: number, ttlMs: number): boolean {
  return now - record.receivedAt > ttlMs
}

/**
 * Exponential backoff with a ceiling: base, 2·base, 4·base, … ≤ max, scaled by a jitter factor
 * in [0.75, 1.25) from `random` (in [0, 1)) so two peers that failed together do not retry together.
 */
export function backoffDelay (attempt: number, baseMs: number, maxMs: number, random = 0.5): number {
  return Math.round(Math.min(maxMs, baseMs * 2 ** Math.min(Math.max(0, attempt), 30)) * (0.75 + 0.5 * random))
}

/**
 * When to first dial a peer learned from gossip, so two peers that learn of each other at once do
 * not dial each other at once: the smaller peer id dials now, the other only if still unconnected
 * after `graceMs` (it may be unreachable that way round).
 */
export function firstDialDelay (selfPeerId: string, peerId: string, graceMs: number): number {
  return selfPeerId < peerId ? 0 : graceMs
}

/** Whether a certificate runs out within `windowMs` (reported in the snapshot so an operator renews it). */
export function expiresSoon (notAfterMs: number, now: number, windowMs: number): boolean {
  return notAfterMs - now <= windowMs
}

/** Load round trips a peer's RTT is taken over. */
export const RTT_WINDOW = 8

/**
 * A peer's round-trip time from its recent load round trips (newest last, at most RTT_WINDOW):
 * the least of them. A round trip also waits for the peer's event loop and ours, so one answer
 * that came late (a busy moment: 25 ms seen where the path is 1 ms) would make the peer look far
 * away to every decision that weighs the link — pulling a KV prefix against recomputing it, a
 * chain's hops, a route's start time — until the next sample.
 */
export function rttEstimate (samples: readonly number[]): number | undefined {
  let least: number | undefined
  for (const s of samples) if (Number.isFinite(s) && s >= 0 && (least === undefined || s < least)) least = s
  return least
}
