/**
 * The coordinator's side of a stage node: a chain token source `watch`es a request it drives and
 * reads back the token, verdict and error frames the last stage returns, the receipt parts every
 * stage sends when it finishes, and the loss of a link to any stage the request runs on.
 */
import { StageLostError, StageWireError } from './errors.ts'
import { remoteError } from './frame-errors.ts'
import type { StageFrame } from './wire.ts'

/** Token and error frames of one coordinated request, plus losses of the peers it runs on. */
export interface TokenWatch {
  /** The next token or verdict frame (`accepted` set for a verdict); rejects with the request's typed error, or signal.reason. */
  next (signal: AbortSignal): Promise<{ position: number, tokenId: number, accepted?: number }>
  /** Signed receipt parts received; waits until `count` stages have answered or the signal fires. */
  parts (count: number, signal: AbortSignal): Promise<Array<Record<string, unknown>>>
  close (): void
}

export interface TokenWatches {
  watch (requestId: string, peers: readonly string[]): TokenWatch
  /** Takes a frame for a watched request; false when the frame is not one (the server's then). */
  deliver (f: StageFrame): boolean
  /** A link went down: every watch running over that peer ends with StageLostError. */
  linkDown (peerId: string): void
  /** Requests watched now. */
  readonly size: number
  /** The longest chain (stages) among the watched requests, at least 1. */
  longestChain (): number
}

interface Watch {
  peers: Set<string>
  queue: Array<{ position: number, tokenId: number, accepted?: number } | Error>
  parts: Array<Record<string, unknown>>
  wake: (() => void) | undefined
}

export function createTokenWatches (): TokenWatches {
  const watches = new Map<string, Watch>()

  const wakeUp = (w: Watch): void => {
    const wake = w.wake
    w.wake = undefined
    wake?.()
  }

  return {
    get size () { return watches.size },
    longestChain () {
      let stages = 1
      for (const w of watches.values()) stages = Math.max(stages, w.peers.size + 1)
      return stages
    },
    deliver (f) {
      const w = watches.get(f.requestId)
      if (w === undefined || !(f.kind === 'token' || f.kind === 'verdict' || f.kind === 'error' || f.kind === 'part')) return false
      if (f.kind === 'part') {
        if (w.parts.length < w.peers.size) w.parts.push(f.part)
      } else {
        w.queue.push(f.kind === 'token' ? { position: f.position, tokenId: f.tokenId } : f.kind === 'verdict' ? { position: f.position, tokenId: f.tokenId, accepted: f.accepted } : remoteError(f.error))
      }
      wakeUp(w)
      return true
    },
    linkDown (peerId) {
      for (const w of watches.values()) {
        if (!w.peers.has(peerId)) continue
        w.queue.push(new StageLostError(`lost the link to stage peer ${peerId}`, peerId))
        wakeUp(w)
      }
    },
    watch (requestId, peers) {
      if (watches.has(requestId)) throw new StageWireError('SHOAL_ERR_STAGE_MALFORMED', `request ${requestId} is already watched`)
      const w: Watch = { peers: new Set(peers), queue: [], parts: [], wake: undefined }
      watches.set(requestId, w)
      return {
        async next (signal) {
          for (;;) {
            const item = w.queue.shift()
            if (item instanceof Error) throw item
            if (item !== undefined) return item
            signal.throwIfAborted()
            await new Promise<void>((resolve, reject) => {
              const onAbort = (): void => { w.wake = undefined; reject(signal.reason) }
              signal.addEventListener('abort', onAbort, { once: true })
              w.wake = () => { signal.removeEventListener('abort', onAbort); resolve() }
            })
          }
        },
        async parts (count, signal) {
          while (w.parts.length < count && !signal.aborted) {
            await new Promise<void>((resolve) => {
              const onAbort = (): void => { w.wake = undefined; resolve() }
              signal.addEventListener('abort', onAbort, { once: true })
              w.wake = () => { signal.removeEventListener('abort', onAbort); resolve() }
            })
          }
          return w.parts.filter(p => Object.keys(p).length > 0)
        },
        close () {
          if (watches.get(requestId) === w) watches.delete(requestId)
        },
      }
    },
  }
}
