// Live updates: on each event of the page's stream, re-fetch its server-rendered fragment.
// An EventSource reconnects by itself, resuming after the last event it received.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live || !window.EventSource || !window.fetch) return;
  var due = null;
  function refresh() {
    due = null;
    fetch(live.dataset.fragment, { credentials: "same-origin", redirect: "error" })
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.text(); })
      .then(function (html) {
        live.innerHTML = html;
        live.dataset.updated = String(Date.now());
      })
      .catch(function () { /* signed out or offline: the page stays as it was */ });
  }
  var source = new EventSource(live.dataset.stream);
  source.onmessage = function () {
    if (due === null) due = setTimeout(refresh, 150); // one fetch for a burst of events
  };
  source.onopen = function () { live.dataset.connected = "true"; };
})();
