/** `shoal serve`: one machine, no mesh — a model directory behind the OpenAI API. */
import { join } from 'node:path'
import { configFrom, startFailure } from '../daemon-config.ts'
import { ExitError } from '../exit-error.ts'
import { cacheRoot } from '../paths.ts'
import { cliLogger, runUntilSignal } from '../run-until-signal.ts'

export async function serve (opts: { model: string, api: string, device: string, draft?: string }): Promise<void> {
  const { createDaemon, parseApiAddress } = await import('../../daemon/node/index.ts')
  let api
  try {
    api = parseApiAddress(opts.api)
  } catch (err) {
    throw new ExitError((err as Error).message)
  }
  const config = await configFrom({
    models: [{ dir: opts.model }],
    api,
    device: opts.device,
    dataDir: join(cacheRoot(), 'serve'),
    cacheRoot: cacheRoot(),
    listen: [],
    bootstrap: [],
    mdns: false,
    ...(opts.draft === undefined ? {} : { draft: opts.draft }),
  })
  const daemon = createDaemon(config, { logger: cliLogger() })
  const started = await daemon.start().catch(startFailure)
  process.stdout.write(`shoal: serving ${opts.model} at ${started.apiUrl}/v1 (node ${started.peerId})\n`)
  await runUntilSignal(daemon.stop)
}
