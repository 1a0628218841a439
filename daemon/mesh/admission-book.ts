/**
 * Admission's bookkeeping, apart from its decisions: who is cooling down after a refusal, who
 * waits for a peer's verdict, which connections have a handshake running, when each connection
 * opened, and the timers that disconnect refused peers. No protocol and no policy here.
 */

interface Waiter { resolve: (admitted: boolean) => void }

export class AdmissionBook {
  private readonly cooldown = new Map<string, number>()
  private readonly waiters = new Map<string, Set<Waiter>>()
  private readonly timers = new Set<ReturnType<typeof setTimeout>>()
  /** Connections (by id) with a handshake in progress, either side. */
  readonly inFlight = new Set<string>()
  /** When each connection became usable (the upgrade done), by id: deadlines count from here. */
  readonly openedAt = new Map<string, number>()
  private readonly now: () => number

  constructor (now: () => number) {
    this.now = now
  }

  inCooldown (peerId: string): boolean {
    const until = this.cooldown.get(peerId)
    if (until === undefined) return false
    if (until > this.now()) return true
    this.cooldown.delete(peerId)
    return false
  }

  coolDown (peerId: string, until: number): void {
    this.cooldown.set(peerId, until)
  }

  /** Resolves with the peer's verdict once `settle` gives one, or false on abort. */
  async wait (peerId: string, signal?: AbortSignal): Promise<boolean> {
    return await new Promise<boolean>(resolve => {
      const set = this.waiters.get(peerId) ?? new Set<Waiter>()
      this.waiters.set(peerId, set)
      const onAbort = (): void => { set.delete(waiter); resolve(false) }
      const waiter: Waiter = {
        resolve: (ok) => { signal?.removeEventListener('abort', onAbort); resolve(ok) },
      }
      set.add(waiter)
      signal?.addEventListener('abort', onAbort, { once: true })
    })
  }

  settle (peerId: string, admitted: boolean): void {
    const set = this.waiters.get(peerId)
    if (set === undefined) return
    this.waiters.delete(peerId)
    for (const w of set) w.resolve(admitted)
  }

  /** Runs `fn` after `ms` unless `clear` comes first. */
  later (fn: () => void, ms: number): void {
    const timer = setTimeout(() => {
      this.timers.delete(timer)
      fn()
    }, ms)
    this.timers.add(timer)
  }

  /** On stop: timers cancelled, open times forgotten, every waiter answered "not admitted". */
  clear (): void {
    for (const t of this.timers) clearTimeout(t)
    this.timers.clear()
    this.openedAt.clear()
    for (const peerId of [...this.waiters.keys()]) this.settle(peerId, false)
  }
}
