/**
 * Ordered start and reverse stop for the daemon's parts. A part that fails to start unwinds the
 * ones already started (js-libp2p's Startable discipline), so a failed boot leaves nothing running.
 */
export interface Part {
  name: string
  start: () => Promise<void>
  stop: () => Promise<void>
}

export interface Lifecycle {
  start: () => Promise<void>
  stop: () => Promise<void>
}

export function createLifecycle (parts: Part[], onStopError: (name: string, err: unknown) => void): Lifecycle {
  const started: Part[] = []
  const stopAll = async (): Promise<void> => {
    while (started.length > 0) {
      const part = started.pop()!
      try {
        await part.stop()
      } catch (err) {
        onStopError(part.name, err)
      }
    }
  }
  return {
    async start () {
      for (const part of parts) {
        try {
          await part.start()
        } catch (err) {
          await stopAll()
          throw err
        }
        started.push(part)
      }
    },
    stop: stopAll,
  }
}
