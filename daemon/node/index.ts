/**
 * The node: builds the daemon's components from a validated config and runs them in order.
 * Commands (`shoal serve`, `shoal node`, `shoal demo`) only parse flags and call this.
 */
export { createDaemon } from './daemon.ts'
export type { Daemon, DaemonComponents } from './daemon.ts'
export { validateConfig, parseApiAddress, parseModelEntry, DEFAULT_BUDGETS } from './config.ts'
export type { Budgets, DaemonConfig, ModelEntry } from './config.ts'
export { chooseEngine } from './device.ts'
export { withReceipts } from './receipted-service.ts'
export { serveForwarded } from './forwarded.ts'
export { ensureDemoReady } from './models.ts'
