/**
 * Ordered start and reverse stop for the daemon's parts. A part that fails to start unwinds the
 * ones already started (js-libp2p's Startable discipline), so a failed boot leaves nothing running.
 * A part's `start` returns what it provides (the ledger part its signer and ledger, the mesh part
 * the mesh), so the parts after it take those as typed arguments instead of sharing variables.
 */
export interface Part<P = void> {
  name: string
  start: () => Promise<P>
  stop: () => Promise<void>
}

/** Parts started one at a time, in the caller's order, each handing its products back. */
export interface Startup {
  /** Starts `part` and returns its products; when it fails, stops every started part (in reverse) and rethrows. */
  start: <P>(part: Part<P>) => Promise<P>
  /** Stops the started parts in reverse; a part that fails to stop is reported, not thrown. */
  stop: () => Promise<void>
}

export function createStartup (onStopError: (name: string, err: unknown) => void): Startup {
  const started: Array<Part<unknown>> = []
  const stopAll = async (): Promise<void> => {
    for (let part = started.pop(); part !== undefined; part = started.pop()) {
      try {
        await part.stop()
      } catch (err) {
        onStopError(part.name, err)
      }
    }
  }
  return {
    async start<P> (part: Part<P>): Promise<P> {
      let products: P
      try {
        products = await part.start()
      } catch (err) {
        await stopAll()
        throw err
      }
      started.push(part)
      return products
    },
    stop: stopAll,
  }
}
