/** `shoal serve`: one machine, no mesh — a model directory behind the OpenAI API. */
import { join } from 'node:path'
import { ExitError } from '../exit-error.ts'
import { cacheRoot } from '../paths.ts'
import { cliLogger, runUntilSignal } from '../run-until-signal.ts'

export async function serve (opts: { model: string, api: string, device: string }): Promise<void> {
  const { createDaemon, parseApiAddress, validateConfig, ConfigError } = await import('../../daemon/node/index.ts')
  let config
  try {
    config = validateConfig({
      models: [{ dir: opts.model }],
      api: parseApiAddress(opts.api),
      device: opts.device,
      dataDir: join(cacheRoot(), 'serve'),
      cacheRoot: cacheRoot(),
      listen: [],
      bootstrap: [],
      mdns: false,
    })
  } catch (err) {
    if (err instanceof ConfigError) throw new ExitError(err.message)
    throw err
  }
  const daemon = createDaemon(config, { logger: cliLogger() })
  let started
  try {
    started = await daemon.start()
  } catch (err) {
    const code = (err as { code?: string }).code
    if (code !== undefined && code.startsWith('SHOAL_ERR_')) throw new ExitError((err as Error).message)
    throw err
  }
  process.stdout.write(`shoal: serving ${opts.model} at ${started.apiUrl}/v1 (node ${started.peerId})\n`)
  await runUntilSignal(daemon.stop)
}
